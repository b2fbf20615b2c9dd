"""`trtopt build`: fuse an exported model into a plan dir (thin over trtopt.builder.pipeline)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from trtopt.cli.common import console


def _print_report(result, explain: bool) -> None:
    report = result.report
    table = Table("pass", "count", title=f"fusions ({report.kind} plan, {result.seconds:.1f} s)")
    for name, count in report.counts.items():
        table.add_row(name, str(count))
    console.print(table)
    facts = result.config.model
    console.print(
        f"[green]built[/] {result.plan_dir}: {facts.num_layers} layers, {facts.num_heads}/{facts.num_kv_heads} heads "
        f"× {facts.head_dim}, vocab {facts.vocab_size}, {facts.dtype}"
        + (f", KV cache {result.config.kv_pool_dtype}" if result.config.kv_cache_dtype != "auto" else "")
        + (f", {'q/k/v' if result.config.kv_cache_rotation == 'hadamard_kv' else 'q/k'} rotated "
           f"({result.config.kv_cache_rotation})" if result.config.kv_cache_rotation != "none" else "")
        + (f", {'K/V' if result.config.kv_cache_smoothing == 'kv' else 'K'} smoothed ({result.kv_calibration})"
           if result.config.kv_cache_smoothing != "none" else "")
        + (f", {result.config.kv_cache_scales} K/V scales ({result.kv_scales})"
           if result.config.kv_cache_scales != "one" else "")
    )
    for note in result.notes:
        console.print(f"[yellow]note[/]: {note}", highlight=False)
    if explain:
        if not report.unfused:
            console.print("every attention-like region fused.")
        for failure in report.unfused:
            console.print("not fused: " + failure.describe(), markup=False, highlight=False, soft_wrap=True)
    elif report.unfused:
        console.print(f"{len(report.unfused)} region(s) left unfused; run with --explain to see why.")
    layout = result.parallel
    if layout is not None:
        console.print(
            f"[green]sharded[/] for {layout.size} rank(s): {layout.heads_per_rank}/{layout.kv_heads_per_rank} heads per "
            f"rank{' (KV heads replicated)' if layout.kv_heads_replicated else ''}, {len(layout.attention)} attention "
            f"+ {len(layout.mlp)} MLP blocks split, {layout.num_all_reduces} all-reduces per step, LM head "
            f"{layout.lm_head}" + (f" ({layout.num_all_gathers} all-gather per step)" if layout.num_all_gathers else "")
        )
        from trtopt.builder.sharding import lm_head_reason, unsharded_reasons

        lines = unsharded_reasons(layout)
        if explain:
            for line in [*lines, *filter(None, [lm_head_reason(layout)])]:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        elif lines:
            console.print(f"{len(lines)} projection(s) left whole on every rank; run with --explain to see why.")


def build(
    model: Path = typer.Argument(..., help="An exported model: a .onnx file or a directory holding model.onnx."),
    output: Path = typer.Option(..., "-o", "--output", help="The plan directory to write."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block: 8, 16, 32, 64 or 128."),
    max_num_tokens: int = typer.Option(2048, "--max-num-tokens", help="Most tokens in one engine step (T)."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Most sequences in one engine step (S)."),
    max_model_len: int = typer.Option(
        None,
        "--max-model-len",
        help="Most tokens (prompt + output) per sequence (default: min(2048, the model's context)).",
    ),
    explain: bool = typer.Option(
        False, "--explain", help="Say, for each region a fusion looked at and left unfused, which check failed."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty plan directory."),
    tensor_parallel: int = typer.Option(
        None, "--tensor-parallel", "--tp",
        help="Shard the plan for N ranks (Megatron-style; writes rank0..rank{N-1}/). Run it with "
        "`trtopt generate/serve --tensor-parallel-size N`.",
    ),
    lm_head: str = typer.Option(
        "replicated", "--lm-head",
        help="With --tensor-parallel: `replicated` (every rank holds the whole LM head; nothing is gathered) or "
        "`vocab-parallel` (each rank holds vocab/N columns; the sampled logits rows are all-gathered every step).",
    ),
    disable_pass: list[str] = typer.Option(
        None, "--disable-pass",
        help="Skip one performance fusion (rope, rope_table, layer_norm, rms_norm, add_rms_norm, horizontal_matmul, "
        "silu_mul, gelu_mul, matmul_add), to measure what it is worth; repeatable.",
    ),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype",
        help="KV pool dtype: `auto` (the model's) or `fp8` (float8 E4M3, per-layer K/V scales of 1.0): half the "
        "bytes of a bf16 cache, so twice the blocks in the same memory. On CUDA it needs compute capability 8.9+.",
    ),
    kv_cache_rotation: str = typer.Option(
        "none", "--kv-cache-rotation",
        help="With --kv-cache-dtype fp8: `none`, `hadamard` (q and k multiplied by one orthonormal Hadamard matrix "
        "before attention, exact before rounding, so the FP8 pools hold rotated keys; needs a power-of-two "
        "head_dim) or `hadamard_kv` (v too: the pools hold rotated values and the output is rotated back). Whether "
        "it lowers FP8's perplexity cost depends on the model: measure it.",
    ),
    kv_cache_smoothing: str = typer.Option(
        "none", "--kv-cache-smoothing",
        help="With --kv-cache-dtype fp8: `none`, `k` (each layer's mean key per head and channel, calibrated at build "
        "time on 8 x 512 tokens of Python's reference manual, subtracted before attention: exact before rounding, "
        "the softmax ignores the shift) or `kv` (the values' mean too, added back after attention). Combines with "
        "--kv-cache-rotation and --tensor-parallel.",
    ),
    kv_cache_scales: str = typer.Option(
        "auto", "--kv-cache-scales",
        help="With --kv-cache-dtype fp8: `auto` (the default: `quantizer` when the source has scales from `trtopt "
        "quantize --kv-cache fp8` and no smoothing or rotation is asked for, else `one`), `quantizer` (those scales: "
        "each layer's amax of the K/V the float model caches / 448, calibrated by the quantizer), "
        "`one` (every layer's K and V scale 1.0, as vLLM without checkpoint scales), "
        "`amax` (each layer's largest |k| and |v| / 448, calibrated at build time on the final graph, after "
        "smoothing and rotation, over the same text as --kv-cache-smoothing) or `amax_head` (per-head scales: amax, "
        "and each KV head multiplied by a power of two that brings it within 2x of the layer's range, exactly "
        "undone on q and the output) or `search` (each layer's K and V scale chosen among 16 in [2, 4) x amax / 448 "
        "by the attention output's error on the calibration text: E4M3's rounding of a few large shared keys, such "
        "as the first token's, depends on the scale); only `one` and `quantizer` with --tensor-parallel.",
    ),
    draft_layers: list[int] = typer.Option(None, "--draft-layers",
                                           help="Also write the self-draft plan of the first N layers to OUTPUT/draft_N "
                                           "(speculative decoding, method self_draft); repeatable."),
):
    """Fuse an exported ONNX model into a plan: attention → trtopt.PagedAttention (KV-cache graphs, rewritten to
    the packed paged signature) or trtopt.FlashAttention (encoders), norms, MatMul+Add. Writes model.onnx,
    plan.json, fusion_report.json and the tokenizer files, and prints the fusion counts.

    Examples:

        trtopt build out/smollm2-onnx -o out/smollm2-plan

        trtopt build model.onnx -o plan --block-size 32 --max-model-len 4096 --explain --force

        trtopt build out/smollm2-onnx -o out/smollm2-fp8kv --kv-cache-dtype fp8 --kv-cache-scales amax
    """
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits

    limits = Limits(block_size=block_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs)
    kv_calibrator = None
    if kv_cache_smoothing != "none" or kv_cache_scales != "one":  # calibration runs the graph: the runtime's job
        from trtopt.runtime.kv_calibration import kv_stats as kv_calibrator
    result = build_plan(
        model, output, limits=limits, max_model_len=max_model_len, force=force, explain=explain, progress=True,
        tensor_parallel=tensor_parallel, lm_head=lm_head, disable_passes=tuple(disable_pass or ()),
        kv_cache_dtype=kv_cache_dtype, kv_cache_rotation=kv_cache_rotation, kv_cache_smoothing=kv_cache_smoothing,
        kv_cache_scales=kv_cache_scales, kv_calibrator=kv_calibrator,
    )
    _print_report(result, explain)
    if draft_layers:
        from trtopt.builder.draft import build_draft_plan

        for n in draft_layers:
            console.print(f"self-draft plan of {n} layers: {build_draft_plan(output, n)}")
