"""End-to-end CPU benchmark: SmolLM2-135M fp32 greedy decode throughput, trtopt vs HF transformers vs onnxruntime-genai.

Every engine runs the same prompts in the same process, one after another, with the same thread count:
- trtopt, torch executor and onnxruntime executor (continuous batching: all requests submitted at once);
- HF transformers `generate` (static batch, left padding);
- onnxruntime-genai, with its own model builder run on the same HF checkpoint.
Each request generates exactly --new-tokens tokens (EOS ignored), so every engine does the same work.
Throughput = generated tokens / wall time of the whole batch (prefill included).

    .venv/bin/python benchmarks/cpu_e2e.py                     # writes docs/benchmarks/cpu_e2e.json + .png
    .venv/bin/python benchmarks/cpu_e2e.py --batches 1 8 --engines trtopt-torch hf
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench_cache"
OUT = ROOT / "docs" / "benchmarks"

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "Explain why the sky is blue in simple terms.",
    "Write a short poem about the sea.",
    "List three benefits of regular exercise:",
    "In computer science, a hash table is",
    "The recipe for a good cup of tea starts with",
    "My favourite book is about",
]


def prompts_for(batch: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]}" if i < len(PROMPTS) else f"({i}) {PROMPTS[i % len(PROMPTS)]}"
            for i in range(batch)]


def ensure_plan() -> Path:
    plan = CACHE / "smollm2-plan"
    if (plan / "plan.json").is_file():
        return plan
    from trtopt.builder.pipeline import build_plan
    from trtopt.export import export_model

    onnx_dir = CACHE / "smollm2-onnx"
    if not (onnx_dir / "model.onnx").is_file():
        export_model("smollm2-135m", onnx_dir, force=True)
    build_plan(onnx_dir, plan, force=True)
    return plan


def ensure_ogenai(hf_dir: Path) -> Path:
    out = CACHE / "smollm2-ogenai"
    if not (out / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                        "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    return out


def run_trtopt(backend: str, plan: Path, batches: list[int], new_tokens: int) -> dict[int, float]:
    from trtopt import LLM, SamplingParams

    # The pool is sized to the workload (every request at full length, plus the null block), the same for both
    # backends. This matters for onnxruntime: under ONNX value semantics its ScatterND copies the whole pool of every
    # layer on every step, so an oversized pool costs it time in proportion (the torch backend writes in place).
    blocks_per_seq = -(-(64 + new_tokens) // 16)
    llm = LLM(plan, backend=backend, max_num_seqs=max(batches), max_num_batched_tokens=2048,
              num_blocks=max(batches) * blocks_per_seq + 1)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts_for(2), SamplingParams(max_tokens=8))  # warm-up
    results = {}
    for b in batches:
        start = time.perf_counter()
        outs = llm.generate(prompts_for(b), params)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == b * new_tokens, tokens
        results[b] = tokens / wall
        print(f"  trtopt-{backend} batch {b}: {results[b]:.1f} tok/s", flush=True)
    return results


def run_hf(hf_dir: Path, batches: list[int], new_tokens: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    results = {}
    with torch.inference_mode():
        model.generate(**tok(prompts_for(2), return_tensors="pt", padding=True), max_new_tokens=8, do_sample=False,
                       pad_token_id=tok.pad_token_id)
        for b in batches:
            enc = tok(prompts_for(b), return_tensors="pt", padding=True)
            start = time.perf_counter()
            out = model.generate(**enc, **kwargs)
            wall = time.perf_counter() - start
            tokens = (out.shape[1] - enc["input_ids"].shape[1]) * b
            results[b] = tokens / wall
            print(f"  hf batch {b}: {results[b]:.1f} tok/s", flush=True)
    return results


def run_ogenai(model_dir: Path, batches: list[int], new_tokens: int) -> dict[int, float]:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    tok = og.Tokenizer(model)
    results = {}
    for b in [1] + batches:  # the first batch-1 run is a warm-up
        tokens_in = tok.encode_batch(prompts_for(b))
        prompt_len = max(len(tok.encode(p)) for p in prompts_for(b))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + new_tokens, min_length=prompt_len + new_tokens,
                                  batch_size=b, do_sample=False)
        start = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(tokens_in)
        steps = 1  # append_tokens ran the prompt and produced the first token's logits
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        wall = time.perf_counter() - start
        results[b] = steps * b / wall
    for b in batches:
        print(f"  onnxruntime-genai batch {b}: {results[b]:.1f} tok/s", flush=True)
    return {b: results[b] for b in batches}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(data["results"])
    batches = data["batches"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        vals = [data["results"][engine].get(str(b), 0) for b in batches]
        xs = [j + i * width for j in range(len(batches))]
        bars = ax.bar(xs, vals, width, label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"{b} requests" for b in batches])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"SmolLM2-135M fp32 greedy, {data['new_tokens']} new tokens, CPU ({data['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--engines", nargs="+", default=["trtopt-torch", "trtopt-onnxruntime", "hf", "onnxruntime-genai"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=OUT / "cpu_e2e.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from trtopt.export.models import resolve_model

    hf_dir = resolve_model("smollm2-135m")
    CACHE.mkdir(exist_ok=True)
    results = {}
    for engine in args.engines:
        print(engine, flush=True)
        if engine.startswith("trtopt-"):
            results[engine] = run_trtopt(engine.removeprefix("trtopt-"), ensure_plan(), args.batches, args.new_tokens)
        elif engine == "hf":
            results[engine] = run_hf(hf_dir, args.batches, args.new_tokens)
        elif engine == "onnxruntime-genai":
            results[engine] = run_ogenai(ensure_ogenai(hf_dir), args.batches, args.new_tokens)
        else:
            raise SystemExit(f"unknown engine {engine!r}")
    data = {
        "benchmark": "cpu_e2e",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "threads": args.threads,
        "model": "SmolLM2-135M-Instruct fp32",
        "new_tokens": args.new_tokens,
        "batches": args.batches,
        "results": {e: {str(b): round(v, 2) for b, v in r.items()} for e, r in results.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
