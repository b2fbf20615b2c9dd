"""Accuracy of the FP8 KV cache (`trtopt build --kv-cache-dtype fp8`) on the CPU: perplexity of one model with pools of
its own dtype and with float8_e4m3fn pools (per-layer scales 1.0), through the engine's prompt_logprobs on the torch
executor. The issue's target: a perplexity increase of at most 0.5%.

Text: trtopt/quantize/data.py's rule (the last --windows x --window tokens of Python's reference manual, held out
from calibration). Each window is one request from an empty KV cache (no prefix caching); every token after the first
is scored. The plans are built with --max-num-tokens 256, so a 512-token window is prefilled in chunks and most of
its tokens attend over keys and values read back from the pool (FP8 in the fp8 plan), not only over the chunk's.
A third cell, fp8_amax, is the fp8 plan with per-layer scales amax / 448 measured on 4 calibration windows (the
model-dtype plan's pools after them; its nodes' k_scale/v_scale rewritten): what a calibration would buy.

How noisy one number is: scaling every K/V scale by 0.95 or 1.05 keeps e4m3's relative error the same (3 mantissa
bits whatever the scale, away from subnormals and saturation) and only moves where values round, yet it moved the
perplexity of 4 windows by more than a point. So the fp8 cell is also run at scales x0.95 and x1.05 (`jitter`), and
the reported increase is the mean of the three with their range: a difference smaller than that range is noise.
Writes docs/benchmarks/fp8_kv_cpu.json.

    python3 benchmarks/fp8_kv.py                      # SmolLM2-135M, 16 windows of 512 tokens
    python3 benchmarks/fp8_kv.py --windows 8 --model tiny-llama
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtopt.builder.pipeline import build_plan  # noqa: E402
from trtopt.builder.plan import Limits, read_plan  # noqa: E402
from trtopt.quantize import data  # noqa: E402
from trtopt.runtime.config import EngineConfig, load_tokenizer  # noqa: E402
from trtopt.runtime.engine import LLMEngine  # noqa: E402
from trtopt.runtime.executors import create_executor  # noqa: E402
from trtopt.runtime.sampling_params import SamplingParams  # noqa: E402

TARGET_DELTA = 0.005  # relative perplexity increase allowed by the issue


def export(model: str, cache: Path) -> Path:
    out = cache / f"{model}-export"
    if not (out / "model.onnx").is_file():
        from trtopt.export import export_model

        export_model(model, out, force=True, log=print)
    return out


def plan(source: Path, cache: Path, kv_cache_dtype: str, window: int) -> Path:
    out = cache / f"{source.name}-plan-{kv_cache_dtype}"
    if not (out / "plan.json").is_file() or read_plan(out).kv_cache_dtype != kv_cache_dtype:
        limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=4, max_model_len=window + 16)
        build_plan(source, out, limits=limits, force=True, progress=False, kv_cache_dtype=kv_cache_dtype)
    return out


def perplexity(plan_dir: Path, windows) -> tuple[float, int, float]:
    """(perplexity, scored tokens, seconds) over `windows`, one request each."""
    config = read_plan(plan_dir)
    engine = LLMEngine(create_executor("torch", plan_dir, config), config, load_tokenizer(plan_dir),
                       EngineConfig(enable_prefix_caching=False, max_num_seqs=1))
    nll, count, start = 0.0, 0, time.perf_counter()
    for i, window in enumerate(windows):
        ids = [int(t) for t in window]
        engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out if out.finished else final
        assert final is not None and final.prompt_logprobs is not None, "the engine returned no prompt logprobs"
        for token, scored in zip(ids[1:], final.prompt_logprobs[1:]):
            nll -= scored[token]
            count += 1
    return math.exp(nll / count), count, time.perf_counter() - start


def amax_scales(plan_dir: Path, windows) -> tuple[list[float], list[float]]:
    """Per-layer K and V scales amax / 448 from the model-dtype plan's pools after running ``windows``."""
    from trtopt.signature import FP8_E4M3_MAX

    config = read_plan(plan_dir)
    executor = create_executor("torch", plan_dir, config)
    engine = LLMEngine(executor, config, load_tokenizer(plan_dir), EngineConfig(enable_prefix_caching=False))
    for i, window in enumerate(windows):
        engine.add_request(str(i), {"prompt_token_ids": [int(t) for t in window]}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    amax = [(float(p[:, 0].abs().max()), float(p[:, 1].abs().max())) for p in executor.kv_caches]
    return [k / FP8_E4M3_MAX for k, _ in amax], [v / FP8_E4M3_MAX for _, v in amax]


def with_scales(plan_dir: Path, out: Path, k_scales: list[float], v_scales: list[float]) -> Path:
    """A copy of the fp8 plan whose PagedAttention nodes carry these scales (the loader refuses hard-linked weights,
    so they are copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in plan_dir.iterdir():
        if f.name != "model.onnx" and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    model = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    for node, k, v in zip(nodes, k_scales, v_scales, strict=True):
        for attr in node.attribute:
            if attr.name in ("k_scale", "v_scale"):
                attr.f = k if attr.name == "k_scale" else v
    onnx.save(model, str(out / "model.onnx"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/trtopt-fp8-kv"))
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "docs/benchmarks/fp8_kv_cpu.json")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    source = export(args.model, args.cache)
    tokenizer = data.load_tokenizer(source)
    slices = data.split_windows(data.corpus_tokens(tokenizer), heldout=(args.windows, args.window),
                                calibration=(data.DEFAULT_CALIBRATION_SEQUENCES, data.DEFAULT_CALIBRATION_LENGTH))
    cells = {}
    for kv in ("auto", "fp8"):
        plan_dir = plan(source, args.cache, kv, args.window)
        ppl, count, seconds = perplexity(plan_dir, slices.heldout)
        cells[kv] = {"kv_pool_dtype": read_plan(plan_dir).kv_pool_dtype, "perplexity": round(ppl, 5),
                     "scored_tokens": count, "seconds": round(seconds, 1)}
        print(kv, cells[kv], flush=True)
    k_scales, v_scales = amax_scales(plan(source, args.cache, "auto", args.window), slices.calibration[:4])
    scaled = with_scales(plan(source, args.cache, "fp8", args.window), args.cache / "plan-fp8-amax", k_scales,
                         v_scales)
    ppl, count, seconds = perplexity(scaled, slices.heldout)
    cells["fp8_amax"] = {"kv_pool_dtype": read_plan(scaled).kv_pool_dtype, "perplexity": round(ppl, 5),
                         "scored_tokens": count, "seconds": round(seconds, 1),
                         "k_scales": [round(x, 5) for x in k_scales], "v_scales": [round(x, 5) for x in v_scales]}
    print("fp8_amax", cells["fp8_amax"], flush=True)
    num_layers = len(k_scales)
    jitter = {"1.0": cells["fp8"]["perplexity"]}
    for mult in (0.95, 1.05):
        jittered = with_scales(plan(source, args.cache, "fp8", args.window), args.cache / f"plan-fp8-x{mult}",
                               [mult] * num_layers, [mult] * num_layers)
        jitter[str(mult)] = round(perplexity(jittered, slices.heldout)[0], 5)
        print(f"fp8 scales x{mult}", jitter[str(mult)], flush=True)
    deltas = [p / cells["auto"]["perplexity"] - 1 for p in jitter.values()]
    delta = sum(deltas) / len(deltas)
    result = {
        "model": args.model, "backend": "torch (CPU, plugins/paged_attention/cpu.py)",
        "text": f"trtopt/quantize/data.py held-out: last {args.windows} x {args.window} tokens",
        "kv_scales": "1.0 per layer (no calibration)", "max_num_tokens": 256, "cells": cells,
        "fp8_perplexity_by_scale_multiplier": jitter,
        "relative_perplexity_increase": round(delta, 6),
        "relative_perplexity_increase_range": [round(min(deltas), 6), round(max(deltas), 6)],
        "relative_perplexity_increase_scale_1": round(deltas[0], 6),
        "target": TARGET_DELTA, "meets_target": delta <= TARGET_DELTA,
        "relative_perplexity_increase_amax_scales": round(cells["fp8_amax"]["perplexity"]
                                                          / cells["auto"]["perplexity"] - 1, 6),
        "host": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
