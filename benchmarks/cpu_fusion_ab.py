"""CPU A/B of a plan-level fusion pass: the same export built with and without it, decode steps timed interleaved.

A random-weight fp32 Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152),
or ``--model`` (an alias or HF dir; ``random-gemma3-270m``: Gemma-3-270m's shape with random weights), is exported
once and built twice; `LLMEngine` on the torch executor (CPU) decodes batch 1 and batch 8, alternating
A, B, A, B, ... so that drift of a shared machine hits both alike. Reports median ms per decode step of each.

    python3 benchmarks/cpu_fusion_ab.py --rule horizontal_matmul --out ab.json
    python3 benchmarks/cpu_fusion_ab.py --rule horizontal_matmul silu_mul add_rms_norm rope all --out ab.json

Several --rule values are compared one after another against the same "with" plan (one export); `all` disables
every plan-level fusion pass named in PLAN_PASSES at once (the plan before issue 11's fusions). The Llama shape has
no GELU; GeGLU is measured on Gemma-3:

    python3 benchmarks/cpu_fusion_ab.py --rule gelu_mul --model gemma3-270m
    python3 benchmarks/cpu_fusion_ab.py --rule gelu_mul --model random-gemma3-270m --device cuda --dtype bf16

``--device cuda`` runs the same A/B on the GPU (torch executor, CUDA graphs on): the same-run GPU measurement of a
pass on a model that gpu_e2e.py's Llama shape does not cover.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_e2e import Shape, make_hf_dir  # noqa: E402

PLAN_PASSES = ("horizontal_matmul", "silu_mul", "gelu_mul", "add_rms_norm", "rope")
SMOLLM2_SHAPE = Shape(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
# Gemma-3-270m's shape (GeGLU MLP 2048 wide, 5 sliding layers per global one): `--model random-gemma3-270m` measures
# gelu_mul where the real checkpoint's packages are not installed (a GPU machine).
GEMMA3_270M_SHAPE = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=262144,
                         sliding_window=512, max_position_embeddings=32768)


def make_gemma3_dir(out: Path) -> Path:
    """A random-weight fp32 Gemma3ForCausalLM of Gemma-3-270m's shape (gelu_pytorch_tanh, the config's default)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_270M_SHAPE, bos_token_id=2, eos_token_id=1, pad_token_id=0)
                      ).save_pretrained(out)
    return out


def decode_ms(plan_dir: Path, batch: int, new_tokens: int, device: str = "cpu") -> list[float]:
    """Per-step wall ms of `new_tokens` decode steps of `batch` requests (prefill excluded)."""
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.config import EngineConfig
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.sampling_params import SamplingParams

    plan = read_plan(plan_dir)
    executor = create_executor("torch", plan_dir, plan, device=device, cuda_graphs=device == "cuda")
    engine = LLMEngine(executor, plan, None, EngineConfig(max_num_seqs=batch, enable_prefix_caching=False))
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": list(range(5 + i, 69 + i))},
                           SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True, temperature=0.0))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rule", nargs="+", default=["horizontal_matmul"],
                    help="pass(es) to compare, one comparison each; `all` = every pass in PLAN_PASSES at once")
    ap.add_argument("--model", help="an alias or HF dir to export instead of the random SmolLM2-shaped Llama, or "
                    "random-gemma3-270m")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the same A/B on the GPU")
    ap.add_argument("--dtype", default="fp32", help="export dtype (fp32, fp16, bf16)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-cpu-ab"))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    args.work.mkdir(parents=True, exist_ok=True)
    source = args.model
    if source is None:
        source = args.work / "hf"
        make_hf_dir(source, SMOLLM2_SHAPE, torch.device("cpu"), dtype=torch.float32)
    elif source == "random-gemma3-270m":
        source = make_gemma3_dir(args.work / "hf-gemma3")
    export_model(source, args.work / "onnx", verify_outputs=False, force=True, dtype=args.dtype)
    limits = Limits(block_size=16, max_num_tokens=1024, max_num_seqs=16, max_model_len=1024)
    with_plan = args.work / "plan"
    build_plan(args.work / "onnx", with_plan, force=True, progress=False, limits=limits)
    results = []
    for rule in args.rule:
        disabled = PLAN_PASSES if rule == "all" else (rule,)
        plans = {"with": with_plan, "without": args.work / f"plan-without-{rule}"}
        build_plan(args.work / "onnx", plans["without"], force=True, progress=False, limits=limits,
                   disable_passes=disabled)
        result = {"rule": rule, "disabled_passes": list(disabled), "shape": args.model or "SmolLM2-135M (random fp32)",
                  "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
                  "new_tokens": args.new_tokens, "rounds": args.rounds}
        for batch in args.batches:
            steps = {"with": [], "without": []}
            for _ in range(args.rounds):
                for name in ("without", "with"):
                    steps[name] += decode_ms(plans[name], batch, args.new_tokens, args.device)
            for name, ms in steps.items():
                result[f"batch{batch}_{name}_ms_per_step"] = statistics.median(ms)
            result[f"batch{batch}_speedup"] = (result[f"batch{batch}_without_ms_per_step"]
                                               / result[f"batch{batch}_with_ms_per_step"])
            print(f"batch {batch}: with {rule} {result[f'batch{batch}_with_ms_per_step']:.2f} ms/step, without "
                  f"{result[f'batch{batch}_without_ms_per_step']:.2f} ms/step (medians of {len(steps['with'])} steps)",
                  flush=True)
        results.append(result)
        if args.out:  # after each comparison, so a run cut short keeps what it measured
            args.out.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")


if __name__ == "__main__":
    main()
