"""Accuracy of `trtopt quantize` measured through the plans `trtopt build` makes of the quantized models (issue 32).

Each cell's quantized model (benchmarks/quant_accuracy.py's cells and quantization, cached under --cache) is built
into a plan and run by the torch executor over the held-out windows, in the same steps as the float export's plan
(benchmarks/fp8_kv.py's step driver: windows from an empty KV cache, prefilled in chunks, every position's logits):
perplexity, Δppl with its paired per-window standard error, mean KL(fp32 || cell) and top-1 agreement with fp32,
and greedy agreement on the chat (or plain) prompts through the engine.

Why a second runner: quant_accuracy.py scores the Q/DQ graphs on onnxruntime, where Gemma-3-270m's 262k-entry
vocabulary costs 1-5 minutes per 4k tokens a cell on the 2-core machine, so its Gemma cells stopped at 8 windows
(4,104 tokens), below issue 32's 16k. A plan computes what its Q/DQ graph computes (tests/fusion_passes/
test_qmatmul.py: the fused graph equals the Q/DQ graph on ORT within 1e-4), and this run checks that on the real
model: `ort_windows` gives each cell's perplexity over the windows quant_accuracy.py scored on ORT (the last ones:
held-out windows are taken from the end of the text), next to ORT's figure from quant_accuracy.json.

A cell's quantized model is reused from --cache when its recorded configuration (the model's
``trtopt.quantization`` metadata) equals the cell's; otherwise it is quantized here (`quantize_model`, as
quant_accuracy.py does).

    python benchmarks/quant_accuracy_plans.py --model gemma3-270m --windows 32 --calibration-sequences 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_kv  # noqa: E402
import quant_accuracy  # noqa: E402

from trtopt.builder.pipeline import build_plan  # noqa: E402
from trtopt.builder.plan import Limits  # noqa: E402
from trtopt.quantize import QuantizeConfig, quantize_model  # noqa: E402
from trtopt.quantize import data  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
DEFAULT_CELLS = ["fp8_weight_only", "fp8_w8a8_static_gptq", "fp8_w8a8_dynamic_gptq", "int4_rtn_asym_g32",
                 "int4_awq_asym_g32"]


def recorded_config(model_dir: Path) -> dict | None:
    path = model_dir / "model.onnx"
    if not path.is_file():
        return None
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return json.loads(props["trtopt.quantization"])["config"] if "trtopt.quantization" in props else None


def quantized(src: Path, name: str, config: QuantizeConfig, cache: Path) -> tuple[Path, str]:
    """(model dir, "reused" | "quantized") for a cell."""
    out = cache / f"{src.name.removesuffix('-export')}-{name}"
    if recorded_config(out) == json.loads(json.dumps(dataclasses.asdict(config))):
        return out, "reused"
    t0 = time.perf_counter()
    quantize_model(src, out, config, force=True, progress=True)
    fp8_kv.log(f"quantized {name} ({time.perf_counter() - t0:.0f} s)")
    return out, "quantized"


def plan_of(model_dir: Path, limits: Limits) -> Path:
    out = model_dir.parent / f"{model_dir.name}-plan"
    stamp = json.dumps({"source": str(model_dir), "mtime": (model_dir / "model.onnx").stat().st_mtime,
                        "limits": dataclasses.asdict(limits)}, sort_keys=True)
    if (out / "plan.json").is_file() and (out / "accuracy_stamp.json").is_file() \
            and (out / "accuracy_stamp.json").read_text() == stamp:
        return out
    t0 = time.perf_counter()
    build_plan(model_dir, out, limits=limits, force=True, progress=False)
    (out / "accuracy_stamp.json").write_text(stamp)
    fp8_kv.log(f"built {out.name} ({time.perf_counter() - t0:.0f} s)")
    return out


def ppl_over(acc: dict, windows: slice) -> float:
    return math.exp(float(acc["nll"][windows].sum()) / float(acc["count"][windows].sum()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--cells", nargs="*", default=DEFAULT_CELLS)
    p.add_argument("--cache", type=Path, default=Path("/tmp/trtopt-quant"))
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--calibration-sequences", type=int, default=data.DEFAULT_CALIBRATION_SEQUENCES)
    p.add_argument("--batch", type=int, default=2, help="windows a step")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk of each window a step")
    p.add_argument("--out", type=Path, default=DOCS / "quant_accuracy.json")
    p.add_argument("--label", help="JSON key (default: <model>-plans)")
    args = p.parse_args()
    t_start = time.perf_counter()
    src = quant_accuracy.export(args.model, args.cache)
    tokenizer = data.load_tokenizer(src)
    slices = data.split_windows(data.corpus_tokens(tokenizer), heldout=(args.windows, quant_accuracy.WINDOW),
                                calibration=(args.calibration_sequences, data.DEFAULT_CALIBRATION_LENGTH))
    heldout = data.with_bos(slices.heldout, tokenizer)
    limits = Limits(block_size=16, max_num_tokens=2048, max_num_seqs=8, max_model_len=2048)
    dirs, sources = {"auto": src}, {"auto": "export"}
    configs = {}
    for name in args.cells:
        config = quant_accuracy.CELLS.get(name) or quant_accuracy.EXTRA_CELLS[name]
        configs[name] = dataclasses.replace(config, calibration_sequences=args.calibration_sequences)
        dirs[name], sources[name] = quantized(src, name, configs[name], args.cache)
    executors = {name: fp8_kv.open_executor(plan_of(d, limits), "cpu") for name, d in dirs.items()}
    fp8_kv.log(f"{args.model}: {len(heldout)} windows x {heldout.shape[1]} tokens, {len(executors)} plans")
    accs = fp8_kv.perplexities(executors, heldout, batch=args.batch, chunk=args.chunk,
                               plan=executors["auto"].plan)
    results = fp8_kv.summarize(accs)
    report = json.loads(args.out.read_text()) if args.out.is_file() else {}
    ort = report.get("models", {}).get(args.model, {}).get("cells", {})
    ort_windows = ort.get("fp32", {}).get("scored_tokens", 0) // quant_accuracy.WINDOW
    tail = slice(len(heldout) - ort_windows, len(heldout)) if ort_windows else None
    cells = {}
    for name, res in results.items():
        key = "fp32" if name == "auto" else name
        cell = {**res, "quantized_model": sources[name]}
        if name != "auto":
            cell["config"] = dataclasses.asdict(configs[name])
        if tail is not None and key in ort:
            cell["ort_windows"] = {"windows": ort_windows, "plan_ppl": round(ppl_over(accs[name], tail), 4),
                                   "ort_ppl": ort[key].get("ppl")}
        cells[key] = cell
        fp8_kv.log(f"  {key}: ppl {res['perplexity']} ({res['delta_ppl_pct']:+.2f}% +- "
                   f"{res['delta_ppl_pct_paired_stderr']}), KL {res['mean_kl_nats']:.2e}, top-1 "
                   f"{res['top1_agreement']:.4f}" + (f"; last {ort_windows} windows plan {cell['ort_windows']['plan_ppl']}"
                                                    f" vs ORT {cell['ort_windows']['ort_ppl']}" if "ort_windows" in cell
                                                    else ""))
    greedy = fp8_kv.greedy_phase(argparse.Namespace(device="cpu"), executors, tokenizer)
    entry = {"model": args.model, "runtime": "trtopt plans on the torch executor (CPU, fp32), "
                                            "benchmarks/quant_accuracy_plans.py",
             "heldout_windows": list(heldout.shape), "bos_prepended": heldout.shape[1] > quant_accuracy.WINDOW,
             "calibration": [args.calibration_sequences, data.DEFAULT_CALIBRATION_LENGTH],
             "steps": f"{args.batch} windows a step in chunks of {args.chunk} tokens",
             "versions": f"python {platform.python_version()} (its pydoc_data text), transformers "
                         f"{transformers.__version__} (its tokenizer)",
             "machine": f"{platform.processor() or platform.machine()}",
             "cells": cells, "greedy_agreement_vs_fp32": greedy, "wall_s": round(time.perf_counter() - t_start)}
    disk = json.loads(args.out.read_text()) if args.out.is_file() else {}
    disk.setdefault("models", {})[args.label or f"{args.model}-plans"] = entry
    args.out.write_text(json.dumps(disk, indent=2) + "\n")
    fp8_kv.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
