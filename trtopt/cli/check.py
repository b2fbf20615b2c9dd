"""`trtopt check`: a plan on every backend, and against its original export (thin over trtopt.check)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trtopt.cli.common import console
from trtopt.errors import ConfigError

_STATUS_STYLE = {"reference": "cyan", "passed": "green", "failed": "bold red", "error": "bold red", "skipped": "dim"}


def check(
    models: list[Path] = typer.Argument(..., help="PLAN, or ORIGINAL.onnx PLAN (an export file or directory, then "
                                        "the plan built from it).", show_default=False),
    backend: list[str] = typer.Option(None, "--backend", "-b", help="A backend to run: torch-cpu, torch-cuda, "
                                      "onnxruntime-cpu, onnxruntime-cuda or tensorrt; repeatable (default: all; those "
                                      "that cannot run here are listed as skipped, with why)."),
    reference: str = typer.Option(None, "--reference", help="The backend the others are compared with (default "
                                  "onnxruntime-cpu, which runs the ops' ONNX function bodies; with ORIGINAL.onnx the "
                                  "original is the reference)."),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="A prompt (tokenized with the plan's tokenizer); "
                                     "repeat for several sequences. Default: random token ids."),
    token_ids: list[str] = typer.Option(None, "--token-ids", help="A prompt as comma-separated token ids; repeatable."),
    seqs: int = typer.Option(3, "--seqs", help="How many random prompts (without --prompt/--token-ids)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    decode_steps: int = typer.Option(4, "--decode-steps", help="All-decode steps after the prompts are in."),
    chunk: int = typer.Option(None, "--chunk", help="Prefill chunk of the first prompt (default: half a block)."),
    atol: float = typer.Option(None, "--atol", help="Absolute tolerance (default: per dtype, see below)."),
    rtol: float = typer.Option(None, "--rtol", help="Relative tolerance (default: per dtype, see below)."),
    layerwise: bool = typer.Option(False, "--layerwise", help="Also compare every layer's attention output and name "
                                   "the first layer over the tolerance (like polygraphy's --onnx-outputs mark all). "
                                   "A quantized plan against its float export: rank the decoder layers by the error "
                                   "each adds quantized alone (one run per layer on held-out text)."),
    min_top1: float = typer.Option(None, "--min-top1", help="Quantized plan vs float export: the least top-1 "
                                   "agreement rate over positions (default 0.85)."),
    max_kl: float = typer.Option(None, "--max-kl", help="Quantized plan vs float export: the largest mean KL(float || "
                                 "quantized) per position, in nats (default 0.1)."),
    max_dlogprob: float = typer.Option(None, "--max-dlogprob", help="Quantized plan vs float export: the largest |Δ "
                                       "log-prob| of the float model's argmax at any position, in nats (default 3)."),
    json_path: Path = typer.Option(None, "--json", help="Write the full report as JSON to this path."),
):
    """Run the same packed prefill and decode steps of several sequences through a plan's paged signature on
    every backend available, and compare their logits (every scheduled row) with a reference; with ORIGINAL.onnx,
    compare the plan with the export it was built from on onnxruntime, the proof that the fusion kept its meaning.
    Prints the max abs/rel errors, the greedy tokens of each backend, and exits 1 when any backend is over the
    tolerance.

    An element mismatches when its absolute error exceeds --atol AND its relative error exceeds --rtol (as
    polygraphy's elemwise check). Defaults per plan dtype: float32 1e-4/1e-4, float16 5e-2/1e-2, bfloat16
    2.5e-1/5e-2. Every backend is fed the reference's greedy tokens, so each step stays comparable.

    A quantized plan (`trtopt quantize`, then `trtopt build`) checked against the float export it was quantized
    from is held to a quantization tolerance instead, on text prompts by default: top-1 agreement >= --min-top1,
    mean KL <= --max-kl and max |Δ logprob| of the float argmax <= --max-dlogprob.

    Examples:

        trtopt check out/plan

        trtopt check out/onnx out/plan --layerwise

        trtopt check out/plan -b torch-cpu -b onnxruntime-cpu -p "The capital of France is" --json check.json

        trtopt check out/onnx out/plan-fp8 --layerwise --json sensitivity.json
    """
    from trtopt.builder.plan import read_plan
    from trtopt.check import Workload, run_check
    from trtopt.check.runner import default_workload

    if len(models) not in (1, 2):
        raise ConfigError(f"give PLAN or ORIGINAL.onnx PLAN; got {len(models)} paths.")
    original, plan_dir = (None, models[0]) if len(models) == 1 else models
    if plan_dir.exists() and not plan_dir.is_dir():
        raise ConfigError(f"{plan_dir} is a file; the last argument is the plan directory (`trtopt build -o DIR`).")
    plan = read_plan(plan_dir) if (plan_dir / "plan.json").is_file() else None
    workload = None
    if plan is not None:
        prompts = _prompts(plan_dir, prompt or [], token_ids or [])
        default = default_workload(plan_dir, plan, quantization=_quantization(plan_dir, original), num_seqs=seqs,
                                   seed=seed, decode_steps=decode_steps)
        workload = Workload(tuple(prompts) if prompts else default.prompts, chunk=chunk or default.chunk,
                            decode_steps=decode_steps, seed=None if prompts else default.seed)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("loading backends", total=None)

        def on_progress(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        report = run_check(plan_dir, original=original, backends=backend or (), reference=reference,
                           workload=workload, atol=atol, rtol=rtol, layerwise=layerwise,
                           quant_tolerance=_quant_tolerance(min_top1, max_kl, max_dlogprob), on_progress=on_progress)
    _print(report)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        console.print(f"report written to {json_path}")
    if not report.passed:
        raise typer.Exit(1)


def _quant_tolerance(min_top1: float | None, max_kl: float | None, max_dlogprob: float | None):
    from trtopt.check.compare import QuantTolerance

    if min_top1 is None and max_kl is None and max_dlogprob is None:
        return None
    default = QuantTolerance()
    return QuantTolerance(default.min_top1 if min_top1 is None else min_top1,
                          default.max_kl if max_kl is None else max_kl,
                          default.max_dlogprob if max_dlogprob is None else max_dlogprob)


def _quantization(plan_dir: Path, original: Path | None) -> bool:
    from trtopt.builder.source import resolve_model_path
    from trtopt.check.runner import is_quantization_check
    from trtopt.errors import TrtOptError

    if original is None or not (plan_dir / "model.onnx").is_file():
        return False
    try:
        return is_quantization_check(plan_dir, resolve_model_path(original))
    except TrtOptError:
        return False  # run_check says what is wrong with the original


def _prompts(plan_dir: Path, texts: list[str], ids: list[str]) -> list[tuple[int, ...]]:
    prompts = []
    for text in ids:
        try:
            prompts.append(tuple(int(t) for t in text.replace(" ", "").split(",") if t))
        except ValueError:
            raise ConfigError(f"--token-ids {text!r} is not a comma-separated list of integers.") from None
    if texts:
        from trtopt.runtime.config import load_tokenizer

        tokenizer = load_tokenizer(plan_dir)
        if tokenizer is None:
            raise ConfigError(f"{plan_dir} has no tokenizer files; pass --token-ids instead of --prompt.")
        prompts += [tuple(tokenizer(t).input_ids) for t in texts]
    return prompts


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _print(report) -> None:
    if report.quantized:
        _print_quantized(report)
        return
    tol = report.tolerance
    table = Table("backend", "status", "logits max abs", "max rel", "over tol.", "greedy = ref", "time",
                  title=f"{report.dtype} plan vs {report.reference}: atol {tol.atol:g}, rtol {tol.rtol:g} (elemwise)")
    for r in report.results:
        style = _STATUS_STYLE.get(r.status, "")
        status = f"[{style}]{r.status}[/]" if style else r.status
        if r.logits is None:
            table.add_row(r.name, status, "", "", "", _agree(report, r), f"{r.seconds:.1f} s" if r.seconds else "")
            continue
        s = r.logits
        table.add_row(r.name, status, _fmt(s.max_abs), _fmt(s.max_rel), f"{s.mismatched}/{s.elements}",
                      _agree(report, r), f"{r.seconds:.1f} s")
    console.print(table)
    for r in report.results:
        if r.reason:
            console.print(f"  {r.name}: {r.reason}", markup=False, highlight=False)
    ref = report.by_name(report.reference)
    console.print(f"greedy tokens of {report.reference} (sequence: tokens):", highlight=False)
    for i, tokens in enumerate(ref.greedy_tokens):
        console.print(f"  {i}: {tokens}", highlight=False)
    if report.layerwise:
        _print_layers(report)
    for r in report.results:
        if r.status in ("failed", "error"):
            console.print(f"[bold red]FAILED[/] {r.name}: {_why(r)}", highlight=False, soft_wrap=True)
    if report.passed:
        console.print(f"[bold green]PASSED[/]: every backend within tolerance of {report.reference}.")


def _agree(report, r) -> str:
    if not r.greedy_tokens:
        return ""
    same, total = report.tokens_agree(r)
    return f"{same}/{total}"


def _print_layers(report) -> None:
    sides = [r for r in report.results if r.layers]
    if not sides:
        return
    table = Table("layer", *(f"{r.name} max abs" for r in sides), title="attention output per layer (max abs error)")
    for layer in range(len(sides[0].layers)):
        cells = []
        for r in sides:
            s = r.layers[layer]
            cells.append(_fmt(s.max_abs) if s.passed else f"[bold red]{_fmt(s.max_abs)} ({s.mismatched} over)[/]")
        table.add_row(str(layer), *cells)
    console.print(table)


def _print_quantized(report) -> None:
    tol = report.tolerance
    table = Table("backend", "status", "top-1 agree", "mean KL", "max KL", "max |Δlogprob|", "positions",
                  "greedy = ref", "time", title=f"quantized {report.dtype} plan vs {report.reference}: top-1 >= "
                  f"{tol.min_top1:g}, mean KL <= {tol.max_kl:g}, max |Δlogprob| <= {tol.max_dlogprob:g} (nats)")
    for r in report.results:
        style = _STATUS_STYLE.get(r.status, "")
        status = f"[{style}]{r.status}[/]" if style else r.status
        if r.logits is None:
            table.add_row(r.name, status, "", "", "", "", "", _agree(report, r),
                          f"{r.seconds:.1f} s" if r.seconds else "")
            continue
        s = r.logits
        table.add_row(r.name, status, f"{s.top1_agreement:.3f}", _fmt(s.mean_kl), _fmt(s.max_kl),
                      _fmt(s.max_dlogprob), str(s.positions), _agree(report, r), f"{r.seconds:.1f} s")
    console.print(table)
    for r in report.results:
        if r.reason:
            console.print(f"  {r.name}: {r.reason}", markup=False, highlight=False)
    if report.sensitivity is not None:
        from trtopt.cli.quantize import sensitivity_table

        console.print(sensitivity_table(report.sensitivity, title="layer sensitivity of the plan on held-out text "
                                        "(each layer quantized alone)"))
    for r in report.results:
        if r.status in ("failed", "error"):
            console.print(f"[bold red]FAILED[/] {r.name}: {_why(r)}", highlight=False, soft_wrap=True)
    if report.passed:
        console.print(f"[bold green]PASSED[/]: every backend within the quantization tolerance of {report.reference}.")


def _why(r) -> str:
    if r.status == "error":
        return r.reason
    from trtopt.check.compare import QuantStats

    if isinstance(r.logits, QuantStats):
        return "; ".join(r.logits.failures())
    parts = []
    if r.logits is not None and not r.logits.passed:
        parts.append(f"{r.logits.mismatched} of {r.logits.elements} logits over the tolerance (max abs "
                     f"{_fmt(r.logits.max_abs)})")
    bad = r.first_bad_layer
    if bad is not None:
        where = ("the error is already in layer 0's attention" if bad == 0 else
                 f"the error entered after layer {bad - 1}'s attention output (its o_proj, MLP or norms, or layer "
                 f"{bad}'s q/k/v projections or attention)")
        parts.append(f"first layer over the tolerance: {bad} ({where})")
    return "; ".join(parts)
