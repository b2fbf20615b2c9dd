"""Accuracy of `trtopt quantize` on real models, all on onnxruntime CPU: perplexity on held-out text and greedy
agreement with the float model, for FP8 W8A8 (static and per-token dynamic), FP8 weight-only, INT4 RTN and INT4 AWQ
(FP8 by round-to-nearest or GPTQ).

Text: trtopt/quantize/data.py's rule (Python's reference manual; calibration = the first 32 x 512 tokens, held out =
the last 32 x 512 tokens; BOS in front of each window when the tokenizer adds one). Perplexity: each 512-token
held-out window runs from an empty KV cache; every token after the first (after BOS, every token) is scored.
Greedy agreement: for each prompt, 32 new tokens from the float model and from the quantized one (no EOS stop); the
fraction of positions holding the same token. Exports and quantized models are cached under
--cache. Writes docs/benchmarks/quant_accuracy.json after every cell (a cut-off run keeps what it measured).

    python3 benchmarks/quant_accuracy.py                          # SmolLM2-135M, every cell
    python3 benchmarks/quant_accuracy.py --model gemma3-270m --cells fp32 fp8_w8a8_static int4_awq_asym_g64
    python3 benchmarks/quant_accuracy.py --model gemma3-270m --windows 8 --calibration-sequences 8 --cells ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtopt.quantize import QuantizeConfig, quantize_model  # noqa: E402
from trtopt.quantize import data  # noqa: E402
from trtopt.quantize.runner import OrtCausalLM  # noqa: E402
from trtopt.signature import LOGITS  # noqa: E402

CELLS: dict[str, QuantizeConfig | None] = {
    "fp32": None,
    "fp8_w8a8_static": QuantizeConfig(weights="fp8", activations="fp8", activation_scales="static"),
    "fp8_w8a8_dynamic": QuantizeConfig(weights="fp8", activations="fp8", activation_scales="dynamic"),
    "fp8_weight_only": QuantizeConfig(weights="fp8"),
    "fp8_w8a8_static_gptq": QuantizeConfig(weights="fp8", activations="fp8", method="gptq"),
    "fp8_w8a8_dynamic_gptq": QuantizeConfig(weights="fp8", activations="fp8", activation_scales="dynamic",
                                            method="gptq"),
    "fp8_weight_only_gptq": QuantizeConfig(weights="fp8", method="gptq"),
    "int4_rtn_sym_g64": QuantizeConfig(weights="int4", group_size=64),
    "int4_rtn_asym_g64": QuantizeConfig(weights="int4", group_size=64, asymmetric=True),
    "int4_rtn_asym_g32": QuantizeConfig(weights="int4", group_size=32, asymmetric=True),
    "int4_awq_asym_g32": QuantizeConfig(weights="int4", group_size=32, asymmetric=True, method="awq"),
    "int4_awq_asym_g64": QuantizeConfig(weights="int4", group_size=64, asymmetric=True, method="awq"),
}
EXTRA_CELLS: dict[str, QuantizeConfig] = {  # variants asked for by name only (clip search on/off ablations)
    "fp8_w8a8_static_clip": QuantizeConfig(weights="fp8", activations="fp8", clip_search=True),
    "fp8_w8a8_dynamic_clip": QuantizeConfig(weights="fp8", activations="fp8", activation_scales="dynamic",
                                            clip_search=True),
    "int4_rtn_asym_g32_clip": QuantizeConfig(weights="int4", group_size=32, asymmetric=True, clip_search=True),
    "int4_awq_asym_g32_noclip": QuantizeConfig(weights="int4", group_size=32, asymmetric=True, method="awq",
                                               clip_search=False),
}
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a hash table is in two sentences.", "Give me three tips for learning Python."]
PLAIN_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                 "A hash table is a data structure that", "The three most important things when learning Python are"]
WINDOWS, WINDOW, NEW_TOKENS = 32, 512, 32


def perplexity(lm: OrtCausalLM, windows: np.ndarray) -> tuple[float, int]:
    nll, count = 0.0, 0
    for window in windows:
        logits = lm.run(window.tolist())[LOGITS.name].reshape(len(window), -1).astype(np.float64)[:-1]
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll += float((logz - logits[np.arange(len(logits)), window[1:]]).sum())
        count += len(window) - 1
    return float(np.exp(nll / count)), count


def prompts_for(tokenizer) -> list[list[int]]:
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for p in CHAT_PROMPTS]
    return [tokenizer(p).input_ids for p in PLAIN_PROMPTS]


def export(model: str, cache: Path) -> Path:
    out = cache / f"{model}-export"
    if not (out / "model.onnx").is_file():
        from trtopt.export import export_model

        export_model(model, out, force=True, log=print)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/trtopt-quant"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=WINDOWS, help="held-out windows of 512 tokens (fewer for a "
                        "big-vocabulary model on a small machine; the cells of one model must share it)")
    parser.add_argument("--calibration-sequences", type=int, default=data.DEFAULT_CALIBRATION_SEQUENCES)
    parser.add_argument("--label", help="the JSON key of this run (default: --model); a run on another machine or "
                        "text gets its own key, since ppl is comparable only within one")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
                        / "quant_accuracy.json")
    args = parser.parse_args()

    src = export(args.model, args.cache)
    tokenizer = data.load_tokenizer(src)
    tokens = data.corpus_tokens(tokenizer)
    slices = data.split_windows(tokens, calibration=(args.calibration_sequences, data.DEFAULT_CALIBRATION_LENGTH),
                                heldout=(args.windows, WINDOW))
    heldout = data.with_bos(slices.heldout, tokenizer)
    calibration = data.with_bos(slices.calibration, tokenizer)
    prompts = prompts_for(tokenizer)
    report = json.loads(args.out.read_text()) if args.out.is_file() else {}
    report.update({
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "text_rule": data.__doc__.split("\n\n")[1].replace("\n", " "),
        "runtime": "onnxruntime CPU, QDQ fusions off (DQ as written, fp32 MatMul); versions and machine per model",
    })
    for key in ("versions", "machine"):  # per model since runs of one file may come from several machines
        report.pop(key, None)
    entry = report.setdefault("models", {}).setdefault(args.label or args.model, {})
    entry.update({"model": args.model, "corpus_tokens": slices.corpus_tokens, "calibration": list(calibration.shape),
                  "heldout_windows": list(heldout.shape), "bos_prepended": heldout.shape[1] > WINDOW,
                  "greedy_prompts": len(prompts), "greedy_new_tokens": NEW_TOKENS,
                  "versions": f"python {platform.python_version()} (its pydoc_data text), transformers "
                              f"{transformers.__version__} (its tokenizer), onnxruntime {ort.__version__}",
                  "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, intra-op "
                             f"threads {args.threads}"})
    cells = entry.setdefault("cells", {})

    base_lm = OrtCausalLM(src / "model.onnx", threads=args.threads)
    reference = [base_lm.greedy(p, NEW_TOKENS) for p in prompts]
    base_ppl = cells.get("fp32", {}).get("ppl")
    for name in args.cells:
        config = CELLS.get(name, EXTRA_CELLS.get(name))
        t0 = time.perf_counter()
        cell: dict = {}
        if name == "fp32":
            lm, path = base_lm, src
        else:
            assert config is not None, f"unknown cell {name}"
            config = dataclasses.replace(config, calibration_sequences=args.calibration_sequences)
            result = quantize_model(src, args.cache / f"{args.model}-{name}", config, force=True, progress=True)
            path = result.out_dir
            cell.update({"config": dataclasses.asdict(config), "describe": config.describe(), "opset": result.opset,
                         "quantized_matmuls": len(result.quantized), "kept_high_precision": result.skipped,
                         "calibration_tokens": result.calibration_tokens,
                         "quantize_seconds": round(result.seconds, 1)})
            if result.awq:
                mse = {"rtn": sum(g.rtn_mse for g in result.awq), "awq_scale": sum(g.awq_mse for g in result.awq),
                       "awq_scale_and_clip": sum(g.final_mse for g in result.awq)}
                cell["awq"] = {"calibration_output_mse_sum": mse,
                               "alphas": [g.alpha for g in result.awq],
                               "folded_into_norm": sum(g.placement == "folded" for g in result.awq),
                               "mul_inserted": sum(g.placement == "mul" for g in result.awq)}
            lm = OrtCausalLM(path / "model.onnx", threads=args.threads)
        t1 = time.perf_counter()
        ppl, scored = perplexity(lm, heldout)
        greedy = [lm.greedy(p, NEW_TOKENS) for p in prompts]
        agree = [float(np.mean([a == b for a, b in zip(g, r)])) for g, r in zip(greedy, reference)]
        if name == "fp32":
            base_ppl = ppl
        cell.update({"ppl": round(ppl, 4), "scored_tokens": scored,
                     "dppl_pct": None if base_ppl is None else round(100 * (ppl / base_ppl - 1), 2),
                     "greedy_agreement": round(float(np.mean(agree)), 4), "greedy_agreement_per_prompt": agree,
                     "eval_seconds": round(time.perf_counter() - t1, 1), "model_bytes": sum(
                         f.stat().st_size for f in Path(path).glob("model.onnx*"))})
        if name == "fp32":
            cell["greedy_text"] = [tokenizer.decode(g) for g in greedy]
        cells[name] = cell
        print(f"{args.model} {name}: ppl {ppl:.4f} ({cell['dppl_pct']}%), greedy agreement {cell['greedy_agreement']}"
              f" [{time.perf_counter() - t0:.0f} s]", flush=True)
        save(args.out, report, args.label or args.model, measured={name: cell})


def save(path: Path, report: dict, label: str, *, measured: dict) -> None:
    """Write ``report`` merged into the file as it is now: another run may have added models or cells meanwhile."""
    disk = json.loads(path.read_text()) if path.is_file() else {}
    models = {**report["models"], **disk.get("models", {})}
    entry = models[label] = {**models.get(label, {}), **{k: v for k, v in report["models"][label].items()
                                                          if k != "cells"}}
    entry["cells"] = {**report["models"][label].get("cells", {}), **entry.get("cells", {}), **measured}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "models": models}, indent=2) + "\n")


if __name__ == "__main__":
    main()
