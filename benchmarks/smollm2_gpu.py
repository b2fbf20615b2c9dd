"""The real SmolLM2-135M on one GPU: batch-1 decode tok/s of trtopt against HF `generate`, same GPU, same run.

A 135M model is the launch-bound extreme: a decode step reads ~0.27 GB (bf16) in ~0.06 ms at HBM speed, so what
this measures is host work and kernel-launch overhead per step, for both engines. Both run greedy decoding of
the same chat prompt for NEW_TOKENS tokens with EOS ignored; trtopt with CUDA graphs (its default on CUDA), HF
`generate` with its default (eager) path, and HF with `cache_implementation="static"` + torch.compile where that
works in this transformers version (reported as such, or as the error it gave).

    python3 benchmarks/smollm2_gpu.py           # on the GPU machine: docs/benchmarks/smollm2_gpu_<gpu>.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs" / "benchmarks"

PROMPT = [{"role": "user", "content": "Explain what a CPU cache is, in a few paragraphs."}]
NEW_TOKENS = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of `repeats` runs after one warm-up run (first-use compiles stay out of the timing)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def trtopt_batch1(plan_dir: Path, prompt_ids: list[int]) -> float:
    from trtopt import LLM, SamplingParams

    llm = LLM(plan_dir, device="cuda", max_num_seqs=8, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seconds = timed(lambda: llm.generate({"prompt_token_ids": prompt_ids}, params))
    del llm
    return NEW_TOKENS / seconds


def hf_batch1(hf_dir: Path, dtype: str, prompt_ids: list[int], compiled: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype]).cuda().eval()
    x = torch.tensor([prompt_ids], device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        seconds = timed(lambda: model.generate(x, **kwargs))
    del model
    torch.cuda.empty_cache()
    return NEW_TOKENS / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/smollm2_gpu"))
    ap.add_argument("--no-compile", action="store_true", help="skip the HF torch.compile baseline")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model
    from trtopt.export.models import resolve_model

    hf_dir = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompt_ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    gpu = torch.cuda.get_device_name()
    rows = []
    for dtype in ("fp32", "bf16"):
        log(f"export + build {dtype}")
        exported = export_model("smollm2-135m", args.work / f"export-{dtype}", dtype=dtype, force=True,
                                verify_outputs=dtype != "bf16")
        plan = build_plan(exported.out_dir, args.work / f"plan-{dtype}", force=True, progress=False,
                          limits=Limits(block_size=16, max_num_tokens=2048, max_num_seqs=8, max_model_len=1024)).plan_dir
        row = {"dtype": dtype, "trtopt_tok_s": trtopt_batch1(plan, prompt_ids)}
        log(f"{dtype} trtopt {row['trtopt_tok_s']:.0f} tok/s")
        row["hf_generate_tok_s"] = hf_batch1(hf_dir, dtype, prompt_ids, compiled=False)
        log(f"{dtype} HF generate {row['hf_generate_tok_s']:.0f} tok/s")
        if not args.no_compile:
            try:
                row["hf_compiled_static_tok_s"] = hf_batch1(hf_dir, dtype, prompt_ids, compiled=True)
                log(f"{dtype} HF compiled {row['hf_compiled_static_tok_s']:.0f} tok/s")
            except Exception as e:  # a baseline that fails is reported, never silently dropped
                row["hf_compiled_static_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"{dtype} HF compiled failed: {row['hf_compiled_static_error']}")
        row["speedup_vs_hf_generate"] = row["trtopt_tok_s"] / row["hf_generate_tok_s"]
        rows.append(row)
    result = {
        "benchmark": "smollm2_gpu", "gpu": gpu, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "python": platform.python_version(),
        "prompt_tokens": len(prompt_ids), "new_tokens": NEW_TOKENS, "batch": 1, "rows": rows,
    }
    DOCS.mkdir(parents=True, exist_ok=True)
    name = "h200" if "H200" in gpu else "h100" if "H100" in gpu else gpu.replace(" ", "_").lower()
    out = DOCS / f"smollm2_gpu_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
