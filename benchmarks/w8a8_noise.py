"""How far two numerically equivalent CPU runs of one quantized SmolLM2-135M bf16 plan drift apart: the noise floor
that tests/e2e/test_gpu_smollm2.py's CUDA-vs-CPU comparison of a quantized plan has to allow.

The plans are the test's (the bf16 export, `quantize_model` RTN, `build_plan` with the e2e LIMITS) and so are the
prompts, sampling (greedy, 48 tokens, top-20 logprobs) and metric (chosen-token |logprob| differences up to the first
differing token; at that token, the reference's top-1 logprob minus the other run's token's: its "margin"). Each
plan runs on the CPU as `LLM(plan, device="cpu")` does (the reference), then once per variant, and every variant is
compared with the reference:

- attention_reference: PagedAttention through its fp32 torch reference instead of the CPU's batched SDPA path
  (TorchExecutor reference_ops): another valid attention, differing from the default by bf16 roundings, as the
  CUDA kernel does.

Two more variants were measured while this was written, through a hook that rebinds a runtime module value (which
tests/test_layout.py forbids, so they are not kept): each QMatMul's x rounded to bf16 (a no-op: the CPU executor
runs a bf16 plan in bf16, so x already is) and each QMatMul's product summed in another fp32 order (max margin 0.5
for W8A8, 0.125 for int4). The JSON keeps their numbers under each plan's "hook_variants".

    timeout 3600 .venv/bin/python benchmarks/w8a8_noise.py                     # every plan (~40 min on 2 cores)
    timeout 1800 .venv/bin/python benchmarks/w8a8_noise.py --plans fp8_w8a8_dynamic

Writes docs/benchmarks/w8a8_cuda_vs_cpu_noise.json (after every plan).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtopt.builder.plan import Limits, read_plan  # noqa: E402
from trtopt.quantize.data import CHAT_QUESTIONS  # noqa: E402
from trtopt.runtime.sampling_params import SamplingParams  # noqa: E402

MODEL = "smollm2-135m"
LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)  # == test_gpu_e2e.LIMITS
MAX_TOKENS = 48
PLANS = {
    "bf16": None,
    "int4_sym_g64": dict(weights="int4", group_size=64),
    "fp8_w8a8_dynamic": dict(weights="fp8", activations="fp8", activation_scales="dynamic"),
}
OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "w8a8_cuda_vs_cpu_noise.json"


def build(cache: Path) -> dict[str, Path]:
    from trtopt.builder.pipeline import build_plan
    from trtopt.export import export_model
    from trtopt.quantize import QuantizeConfig, quantize_model

    export = cache / "export"
    if not (export / "model.onnx").exists():
        export_model(MODEL, export, dtype="bf16", force=True, verify_outputs=False, log=print)
    plans = {}
    for name, config in PLANS.items():
        plan = cache / f"plan-{name}"
        if not (plan / "model.onnx").exists():
            src = export
            if config is not None:
                src = quantize_model(export, cache / f"q-{name}", QuantizeConfig(**config), force=True).out_dir
            build_plan(src, plan, limits=LIMITS, force=True, progress=False)
        plans[name] = plan
    return plans


def generate(plan_dir: Path, *, reference_ops=()) -> list[dict]:
    from trtopt.runtime.config import EngineConfig, load_tokenizer
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    plan = read_plan(plan_dir)
    executor = TorchExecutor(plan_dir, plan, device="cpu", reference_ops=reference_ops)
    engine = LLMEngine(executor, plan, load_tokenizer(plan_dir), EngineConfig())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=20)
    for i, q in enumerate(CHAT_QUESTIONS):
        engine.add_request(str(i), [{"role": "user", "content": q}], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [dict(tokens=list(done[str(i)].token_ids),
                 logprobs=[{int(t): float(v) for t, v in d.items()} for d in done[str(i)].logprobs])
            for i in range(len(CHAT_QUESTIONS))]


def compare(ref: list[dict], other: list[dict]) -> dict:
    """The e2e test's metric, `other` in the CUDA run's place: chosen-token |Δ logprob| up to the first differing
    token, and there the reference's margin of its own token over other's (None: outside its top 20)."""
    worst, diffs, margins = 0.0, [], []
    for i, (r, o) in enumerate(zip(ref, other)):
        j = next((k for k, (a, b) in enumerate(zip(o["tokens"], r["tokens"])) if a != b), None)
        same = len(o["tokens"]) if j is None else j
        for k in range(min(same, len(r["tokens"]))):
            t = o["tokens"][k]
            d = abs(o["logprobs"][k][t] - r["logprobs"][k][t])
            diffs.append(d)
            worst = max(worst, d)
        if j is not None:
            top = r["logprobs"][j]
            m = top[r["tokens"][j]] - top[o["tokens"][j]] if o["tokens"][j] in top else None
            margins.append([i, j, None if m is None else round(m, 4), round(top[r["tokens"][j]], 4)])
    diffs.sort()
    known = [m[2] for m in margins if m[2] is not None]
    return dict(max_abs_logprob_diff=round(worst, 4),
                p99_abs_logprob_diff=round(diffs[int(0.99 * (len(diffs) - 1))], 4) if diffs else 0.0,
                positions_compared=len(diffs), identical_prompts=len(ref) - len(margins),
                max_margin=max(known) if known else None,
                divergences_prompt_token_margin_reftop1=margins)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path("/tmp/trtopt-w8a8-noise"))
    p.add_argument("--plans", nargs="+", default=list(PLANS))
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    torch.set_num_threads(2)
    plans = build(args.cache)
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(model=MODEL, prompts=len(CHAT_QUESTIONS), max_tokens=MAX_TOKENS, host=platform.node(),
                  torch=torch.__version__)
    result.setdefault("plans", {})
    for name in args.plans:
        start = time.perf_counter()
        ref = generate(plans[name])
        cell = dict(reference_seconds=round(time.perf_counter() - start, 1), variants={})
        print(f"{name}: reference {cell['reference_seconds']} s", flush=True)
        start = time.perf_counter()
        cmp = compare(ref, generate(plans[name], reference_ops=("PagedAttention",)))
        cmp["seconds"] = round(time.perf_counter() - start, 1)
        cell["variants"]["attention_reference"] = cmp
        print(f"  attention_reference: {json.dumps(cmp)}", flush=True)
        earlier = result["plans"].get(name, {})
        if "hook_variants" in earlier:
            cell["hook_variants"] = earlier["hook_variants"]
        result["plans"][name] = cell
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
