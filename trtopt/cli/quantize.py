"""`trtopt quantize`: an exported model -> the same model with standard Q/DQ nodes (thin over trtopt.quantize)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from trtopt.cli.common import console


def sensitivity_table(report, *, title: str, excluded: int = 0) -> Table:
    """A SensitivityReport as a table, most sensitive first (the first ``excluded`` rows marked kept float)."""
    from trtopt.quantize.sensitivity import short_names

    full = report.full
    table = Table("rank", "layer", "mean KL", "max KL", "top-1", "max |Δlogprob|", "MatMuls",
                  title=f"{title}: {report.tokens} tokens; all quantized: mean KL {full.mean_kl:.3g}, top-1 "
                  f"{full.top1_agreement:.3f}")
    for rank, row in enumerate(report.layers, start=1):
        s = row.stats
        layer = f"[bold yellow]{row.layer} kept[/]" if rank <= excluded else row.layer
        table.add_row(str(rank), layer, f"{s.mean_kl:.3g}", f"{s.max_kl:.3g}", f"{s.top1_agreement:.3f}",
                      f"{s.max_dlogprob:.3g}", short_names(row.matmuls))
    return table


def _print_result(result) -> None:
    config = result.config
    console.print(f"[green]quantized[/] {len(result.quantized)} MatMul(s) to {config.describe()} at opset "
                  f"{result.opset} in {result.seconds:.1f} s"
                  + (f", calibrated on {result.calibration_tokens} tokens" if result.calibration_tokens else "")
                  + f": {result.model_path}", highlight=False)
    if result.kv_cache:
        k, v = result.kv_cache["k_scales"], result.kv_cache["v_scales"]
        console.print(f"FP8 KV cache scales (amax / 448 per layer, for `trtopt build --kv-cache-dtype fp8`): K "
                      f"{min(k):.3g}..{max(k):.3g}, V {min(v):.3g}..{max(v):.3g}", highlight=False)
    if result.sensitivity is not None:
        console.print(sensitivity_table(result.sensitivity, title="layer sensitivity on calibration text (each "
                                        "layer quantized alone)", excluded=config.auto_exclude))
    auto = {n for layer in result.sensitivity.most_sensitive(config.auto_exclude) for n in layer.nodes} \
        if result.sensitivity is not None else set()
    for node, why in result.skipped.items():
        if node not in auto:
            console.print(f"kept high precision: {node} ({why})", markup=False, highlight=False)
    if auto:
        layers = result.sensitivity.most_sensitive(config.auto_exclude)
        console.print(f"kept high precision by --exclude auto:{config.auto_exclude} (the layers whose quantization "
                      "alone moves the logits most): " + ", ".join(f"layer {r.layer} ({len(r.nodes)} MatMuls, mean KL "
                      f"{r.stats.mean_kl:.3g})" for r in layers), markup=False, highlight=False)
    if result.awq:
        table = Table("MatMuls", "alpha", "1/s goes", "RTN MSE", "AWQ MSE", "+ clip",
                      title="AWQ (calibration output MSE)")
        for group in result.awq:
            table.add_row(", ".join(group.matmuls), f"{group.alpha:.2f}", group.placement, f"{group.rtn_mse:.3g}",
                          f"{group.awq_mse:.3g}", f"{group.final_mse:.3g}")
        console.print(table)


def quantize(
    model: Path = typer.Argument(..., help="An exported model: a directory holding model.onnx (`trtopt export`) or "
                                 "a .onnx file."),
    output: Path = typer.Option(..., "-o", "--output", help="The model directory to write (model.onnx + config and "
                                "tokenizer files)."),
    weights: str = typer.Option("fp8", "--weights", help="fp8 (e4m3, per output channel) or int4 (blocked over K)."),
    activations: str = typer.Option(None, "--activations",
                                    help="fp8: also quantize MatMul inputs (W8A8, needs --weights fp8); "
                                    "default: weight-only."),
    activation_scales: str = typer.Option("static", "--activation-scales",
                                          help="static (one calibrated scale per tensor) or dynamic (per token, "
                                          "computed in the graph)."),
    method: str = typer.Option(None, "--method", help="rtn (round to nearest), awq (int4: activation-aware "
                               "scales searched on calibration text) or gptq (rounding that compensates each "
                               "error on calibration text; fp8 or int4). Default: gptq for fp8, rtn for int4."),
    group_size: int = typer.Option(128, "--group-size", help="INT4 block size over K; must divide every K."),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="INT4: uint4 with a zero point (default: "
                                    "symmetric int4)."),
    clip_search: bool = typer.Option(None, "--clip-search/--no-clip-search",
                                     help="Search a clip ratio per channel/group (the layer output error when the "
                                     "method calibrates, else the weight error; default: on for awq and gptq, off "
                                     "for rtn)."),
    exclude: list[str] = typer.Option(None, "--exclude", help="Keep MatMuls whose node or weight name matches this "
                                      "fnmatch pattern in high precision; repeatable (the LM head always is). "
                                      "auto[:N]: also keep the N decoder layers (default 2) whose quantization alone "
                                      "moves the logits most (mean KL on calibration text; one run per layer)."),
    calibration_sequences: int = typer.Option(32, "--calibration-sequences",
                                              help="Calibration windows of Python's reference manual."),
    calibration_length: int = typer.Option(512, "--calibration-length", help="Tokens per calibration window."),
    threads: int = typer.Option(2, "--threads", help="onnxruntime intra-op threads for calibration."),
    kv_cache: str = typer.Option(None, "--kv-cache", help="fp8: also calibrate the FP8 KV cache's per-layer K and V "
                                 "scales on the calibration text and record them in the model, where `trtopt build "
                                 "--kv-cache-dtype fp8` takes them."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty output directory."),
):
    """Quantize an exported model into standard QuantizeLinear/DequantizeLinear ONNX (TensorRT's explicit
    quantization): FP8 W8A8 with static or per-token dynamic activation scales, FP8 weight-only, or INT4 W4A16 by
    RTN or AWQ. Embeddings and the LM head stay in the model's precision. Calibration text is Python's own reference
    manual (nothing is downloaded).

    Examples:

        trtopt quantize out/onnx -o out/onnx-fp8 --weights fp8 --activations fp8

        trtopt quantize out/onnx -o out/onnx-fp8-dyn --weights fp8 --activations fp8 --activation-scales dynamic

        trtopt quantize out/onnx -o out/onnx-w4 --weights int4 --group-size 64 --asymmetric --method awq

        trtopt quantize model.onnx -o q --weights int4 --group-size 32 --exclude "*mlp*" --force

        trtopt quantize out/onnx -o out/onnx-fp8 --weights fp8 --activations fp8 --exclude auto:2

        trtopt quantize out/onnx -o out/onnx-fp8kv --weights fp8 --activations fp8 --kv-cache fp8
    """
    from trtopt.quantize import QuantizeConfig, quantize_model
    from trtopt.quantize.api import default_method, parse_exclude

    patterns, auto_exclude = parse_exclude(exclude or ())
    config = QuantizeConfig(weights=weights, activations=activations, activation_scales=activation_scales,
                            method=method or default_method(weights), group_size=group_size, asymmetric=asymmetric,
                            clip_search=clip_search,
                            exclude=patterns, auto_exclude=auto_exclude, calibration_sequences=calibration_sequences,
                            calibration_length=calibration_length, threads=threads, kv_cache=kv_cache)
    _print_result(quantize_model(model, output, config, force=force, progress=True))
