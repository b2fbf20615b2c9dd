"""`trtopt export`: HF causal LM → ONNX, verified against PyTorch."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from trtopt.cli.common import console


def export(
    model: str = typer.Argument(..., help="An HF causal-LM directory, or a built-in alias: smollm2-135m, tiny-llama, tiny-gpt2, tiny-qwen2."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (model.onnx, config.json, tokenizer files)."),
    exporter: str = typer.Option("dynamo", help="dynamo (torch.onnx.export(dynamo=True)) or legacy (TorchScript)."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16."),
    opset: int = typer.Option(None, help="ONNX opset (default: 18 for dynamo, 17 for legacy)."),
    verify: bool = typer.Option(None, "--verify/--no-verify", show_default=False,
                                help="Compare ONNX Runtime with PyTorch after export [default: on, except for bf16, "
                                "which ORT's CPU kernels do not run]."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty output directory."),
):
    """Export an HF causal LM to ONNX with optimum-style I/O (input_ids, attention_mask, position_ids,
    past_key_values.* → logits, present.*) and verify it on ONNX Runtime against PyTorch.

    Examples:

        trtopt export smollm2-135m -o out/smollm2-onnx

        trtopt export ./my-llama --exporter legacy --dtype fp16 -o out/llama-onnx --force
    """
    from trtopt.export import export_model

    with console.status("exporting…") as status:
        result = export_model(model, output, exporter=exporter, dtype=dtype, opset=opset, verify_outputs=verify,
                              force=force, log=lambda msg: status.update(msg + "…"))
    console.print(f"[green]exported[/] {model} → {result.onnx_path}  ({result.exporter}, opset {result.opset}, "
                  f"{result.seconds:.1f} s)")
    if result.unverified_because:
        console.print(f"[yellow]not verified:[/] {result.unverified_because}.")
    if result.max_abs_error:
        table = Table("verification vs PyTorch", "max abs error", "max error / max(1,|ref|)", title="ONNX Runtime parity")
        for case, err in result.max_abs_error.items():
            table.add_row(case, f"{err:.2e}", f"{result.max_rel_error[case]:.2e}")
        console.print(table)
