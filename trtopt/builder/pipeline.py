"""`trtopt build`: run the fusion pipeline on an exported model and write the plan dir (docs/architecture.md §1).

Four steps, each a function with a typed value between them:

    build_plan args ──validate_options──▶ BuildOptions ──fuse──▶ FusedGraph ──shard──▶ ShardedGraph | None
                                                                                          │ rotate, store_fp8
    plan dir ◀──write── model.onnx (+ .data) or rank{r}/, plan.json, fusion_report.json, tokenizer + config files

``fuse`` loads the source (source.py), runs the fusion passes (fusion_passes/pipeline.py) and validates the plan
graph (with --kv-cache-smoothing it also calibrates the K/V means, through the caller's calibrator, and subtracts
them before attention: builder/kv_calibration.py, fusion_passes/kv_smoothing.py); ``shard`` (--tensor-parallel only)
rewrites it into the rank graph (sharding/analysis.py); ``rotate`` (--kv-cache-rotation only) rotates q and k before
attention (fusion_passes/kv_rotation.py); ``store_fp8`` (--kv-cache-dtype fp8 only) makes the pools float8 E4M3, with
per-layer K/V scales calibrated on the final graph under --kv-cache-scales amax (and per-head powers of two under
amax_head: fusion_passes/kv_head_scales.py); ``write`` attaches the trtopt op functions and writes the files
(plan_files.py, sharding/writer.py, plan.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from trtopt.builder.model_facts import (
    config_disagreements,
    context_length,
    head_dims_from_config,
    model_facts,
    read_json,
)
from trtopt.builder.kv_calibration import KvCalibrator, KvStats, calibration_windows
from trtopt.builder.plan import REPORT_FILE, Limits, ModelFacts, PlanConfig, write_plan
from trtopt.builder.plan_files import copy_side_files, save_model
from trtopt.builder.sharding import (
    LM_HEAD_MODES,
    ParallelLayout,
    ShardResult,
    join_fused,
    parallel_config,
    shard_structure,
    write_rank_plans,
)
from trtopt.builder.signature import check_signature
from trtopt.builder.source import load_source, resolve_model_path
from trtopt.errors import BuildError, ConfigError
from trtopt.fusion_passes.kv_rotation import head_dims, is_power_of_two, rotate_qk
from trtopt.fusion_passes.horizontal_matmul import fuse_horizontal_matmul
from trtopt.fusion_passes.kv_head_scales import scale_kv_heads
from trtopt.fusion_passes.kv_smoothing import smooth_kv
from trtopt.fusion_passes.paged_attention import use_fp8_kv_cache
from trtopt.fusion_passes.pipeline import OPTIONAL_PASSES, FusionReport, optimize
from trtopt.fusion_passes.trace import Trace
from trtopt.plugins import attach_functions
from trtopt.plugins.paged_attention.function import attach_fp8_kv_function
from trtopt.signature import (KV_CACHE_DTYPES, KV_CACHE_ROTATIONS, KV_CACHE_SCALES, KV_CACHE_SCALES_AUTO,
                              KV_CACHE_SMOOTHINGS)

BLOCK_SIZES = (8, 16, 32, 64, 128)  # the kernels' tested sizes; powers of two keep slot math cheap


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """The checked inputs of one build (validate_options -> fuse, shard, write)."""

    onnx_path: Path  # the source model.onnx; its directory holds config.json and the tokenizer files
    out_dir: Path  # the plan dir to write (checked: not the source dir, empty unless --force)
    config_json: dict  # config.json beside the source ({} when absent)
    generation_json: dict  # generation_config.json beside the source ({} when absent)
    limits: Limits  # checked, max_model_len fitted to the model's context (fit_limits)
    tensor_parallel: int | None  # ranks to shard for; None: an unsharded plan
    lm_head: str  # one of LM_HEAD_MODES ("replicated" unless tensor_parallel)
    disable_passes: tuple[str, ...]  # OPTIONAL_PASSES to skip
    explain: bool  # recorded in fusion_report.json
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: "fp8" stores the KV pools as float8_e4m3fn
    kv_cache_rotation: str = "none"  # KV_CACHE_ROTATIONS: "hadamard" rotates q and k, "hadamard_kv" v too (fp8 only)
    kv_cache_smoothing: str = "none"  # one of KV_CACHE_SMOOTHINGS: "k"/"kv" subtract calibrated means (fp8 only)
    kv_cache_scales: str = "one"  # one of KV_CACHE_SCALES: "amax" calibrates the FP8 K/V scales (fp8 only)
    kv_calibrator: KvCalibrator | None = None  # runs the graph for the two above (the runtime's kv_stats)
    # with kv_cache_scales "quantizer": the (K, V) scales per layer the source's quantizer recorded
    quantizer_kv_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    kv_scales_note: str = ""  # why the source's quantizer scales were not taken (the build summary's notes)


@dataclasses.dataclass
class FusedGraph:
    """The fused, validated plan graph (fuse -> shard, write)."""

    model: ir.Model | None  # the plan graph; shard rewrites it in place, write consumes it (then None)
    report: FusionReport  # the fusion counts, plan kind and unfused regions
    facts: ModelFacts  # read off the fused graph (global head counts): the top-level plan.json's
    notes: tuple[str, ...]  # where config.json and the graph disagreed (the graph won)
    kv_means: KvStats | None = None  # with --kv-cache-smoothing: the calibration whose means the graph subtracts
    kv_amax: KvStats | None = None  # with --kv-cache-scales: the calibration (of the final graph) of the scales
    kv_scales: tuple[list[float], list[float]] | None = None  # with --kv-cache-scales: every layer's K and V scale


@dataclasses.dataclass(frozen=True)
class ShardedGraph:
    """The tensor-parallel rank graph's layout and per-rank weights (shard -> write)."""

    result: ShardResult  # the layout, and what gives each rank its weight slices
    rank_facts: ModelFacts  # read off the rank graph (per-rank head counts): each rank{r}/plan.json's


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `trtopt build` produced."""

    plan_dir: Path
    config: PlanConfig
    report: FusionReport
    seconds: float
    parallel: ParallelLayout | None = None  # the tensor-parallel layout, when built with tensor_parallel
    notes: tuple[str, ...] = ()  # where config.json and the graph disagree (the graph won)
    kv_calibration: str = ""  # with --kv-cache-smoothing: what the means were calibrated on, and its cost
    kv_scales: str = ""  # with --kv-cache-scales amax: the scales' range, what they were calibrated on, and its cost


def validate_limits(limits: Limits) -> None:
    """ConfigError for option values the runtime cannot honour."""
    if limits.block_size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size {limits.block_size} is not supported; choose one of {list(BLOCK_SIZES)}.")
    for name in ("max_num_tokens", "max_num_seqs", "max_model_len"):
        value = getattr(limits, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
    if limits.max_num_seqs > limits.max_num_tokens:
        raise ConfigError(
            f"--max-num-seqs {limits.max_num_seqs} exceeds --max-num-tokens {limits.max_num_tokens}: every scheduled "
            "sequence needs at least one token per step. Lower --max-num-seqs or raise --max-num-tokens."
        )


def _check_out_dir(out_dir: Path, source_dir: Path, force: bool) -> None:
    """Refuse a bad plan dir before any work is done."""
    if out_dir.resolve() == source_dir.resolve():
        raise BuildError(f"the plan dir {out_dir} is the model's own directory; choose another -o.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise BuildError(f"{out_dir} already exists and is not empty; pass --force to overwrite it.")


def _prepare_out_dir(out_dir: Path) -> None:
    """Empty (with --force, already checked) and create the plan dir; only called once the plan is ready."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        if out_dir.is_dir():
            shutil.rmtree(out_dir)
        else:
            out_dir.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


class _Steps:
    """Rich progress for the long steps; silent when progress is off (tests, libraries)."""

    def __init__(self, enabled: bool):
        self._progress = None
        if enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False
            )

    @contextlib.contextmanager
    def run(self) -> Iterator[_Steps]:
        if self._progress is None:
            yield self
            return
        with self._progress:
            yield self

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        if self._progress is None:
            yield
            return
        task = self._progress.add_task(description, total=1)
        yield
        self._progress.update(task, completed=1)

    @contextlib.contextmanager
    def bar(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        """A step of ``total`` parts; yields the function that marks one done."""
        if self._progress is None:
            yield lambda: None
            return
        task = self._progress.add_task(f"{description} (0/{total})", total=total)
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            self._progress.update(task, advance=1, description=f"{description} ({done}/{total})")

        yield advance


def _op_summary(model: ir.Model, limit: int = 8) -> str:
    counts = collections.Counter(node.op_type for node in model.graph.all_nodes())
    top = ", ".join(f"{op}×{n}" for op, n in counts.most_common(limit))
    return top + (f" and {len(counts) - limit} more op types" if len(counts) > limit else "")


def _refuse_non_transformer(model: ir.Model, report: FusionReport, onnx_path: Path) -> None:
    """BuildError for a graph with neither KV-cache I/O nor one fused attention: it is not an LLM or an encoder.

    A plan without attention would be a 0-layer plan that the runtime cannot serve; saying what the graph holds
    instead tells the user at once that they pointed at the wrong model (or at an attention form to report).
    """
    if report.kind != "flash" or report.counts.get("flash_attention", 0):
        return
    inputs = ", ".join(v.name for v in model.graph.inputs) or "none"
    if report.unfused:
        found = (f"{len(report.unfused)} Softmax region(s) examined as attention, none of which fused:\n  "
                 + "\n  ".join(Trace(list(report.unfused)).summary()) + "\n(run with --explain for each one)")
    else:
        found = f"no attention (Softmax over q·kᵀ) at all; its ops are {_op_summary(model)}"
    raise BuildError(
        f"{onnx_path} is not a causal LM or a transformer encoder: it has no KV-cache inputs "
        f"(past_key_values.*; inputs: {inputs}) and {found}. trtopt builds decoder-only LMs exported with "
        "`trtopt export` (or optimum's text-generation-with-past) and encoders whose attention it can fuse."
    )


def _probe_len(limits: Limits, config: dict) -> int:
    """The longest (past + new) length the mask probe evaluates: every length the plan serves, and past the
    sliding window config.json states (so a window is seen, not mistaken for plain causal attention when it is
    wider than --max-model-len; the graph's own mask decides what the window is). The probe evaluates only a few
    query rows at this length, so even a 32K context costs a [3, 32K] mask."""
    window = int(config.get("sliding_window") or 0)
    return max(limits.max_model_len, window + 8 if window else 0, 16)


def fit_limits(limits: Limits | None, max_model_len: int | None, context: int) -> Limits:
    """The context-length rule, written once: ``limits`` (default Limits()) with max_model_len set to
    ``max_model_len`` when given, else capped at the model's ``context`` (its max_position_embeddings as
    model_facts.context_length reads config.json; 0 = unknown, no cap).

    An explicit max_model_len beyond a known context is a ConfigError.
    """
    limits = limits or Limits()
    if max_model_len is not None:
        if context and max_model_len > context:
            raise ConfigError(
                f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {context}; lower it."
            )
        return dataclasses.replace(limits, max_model_len=max_model_len)
    if context and limits.max_model_len > context:
        return dataclasses.replace(limits, max_model_len=context)
    return limits


# ---------------------------------------------------------------------------------------------------------------
# The steps: validate -> fuse -> shard -> write.


def validate_options(
    model_path: str | Path,
    out_dir: str | Path,
    *,
    limits: Limits | None,
    max_model_len: int | None,
    force: bool,
    explain: bool,
    tensor_parallel: int | None,
    lm_head: str,
    disable_passes: Sequence[str],
    kv_cache_dtype: str = "auto",
    kv_cache_rotation: str = "none",
    kv_cache_smoothing: str = "none",
    kv_cache_scales: str = KV_CACHE_SCALES_AUTO,
    kv_calibrator: KvCalibrator | None = None,
) -> BuildOptions:
    """Check every option and the source and plan paths before any work is done (build_plan's arguments)."""
    onnx_path = resolve_model_path(Path(model_path))
    source_dir = onnx_path.parent
    out_dir = Path(out_dir)
    config_json = read_json(source_dir / "config.json")
    generation_json = read_json(source_dir / "generation_config.json")
    limits = fit_limits(limits, max_model_len, context_length(config_json))
    validate_limits(limits)
    if tensor_parallel is not None and (not isinstance(tensor_parallel, int) or tensor_parallel < 1):
        raise ConfigError(f"--tensor-parallel must be a positive integer, got {tensor_parallel!r}.")
    if lm_head not in LM_HEAD_MODES:
        raise ConfigError(f"--lm-head {lm_head!r}: choose one of {', '.join(LM_HEAD_MODES)}.")
    if lm_head != "replicated" and tensor_parallel is None:
        raise ConfigError(f"--lm-head {lm_head} splits the LM head over tensor-parallel ranks; "
                          "add --tensor-parallel N.")
    unknown = sorted(set(disable_passes) - set(OPTIONAL_PASSES))
    if unknown:
        raise ConfigError(f"--disable-pass {', '.join(unknown)}: no such optional pass; choose from "
                          f"{', '.join(OPTIONAL_PASSES)}.")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; choose one of "
                          f"{', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8: float8 E4M3 pools).")
    if kv_cache_rotation not in KV_CACHE_ROTATIONS:
        raise ConfigError(f"--kv-cache-rotation {kv_cache_rotation!r} is not supported; choose one of "
                          f"{', '.join(KV_CACHE_ROTATIONS)}.")
    if kv_cache_rotation != "none" and kv_cache_dtype != "fp8":
        raise ConfigError(f"--kv-cache-rotation {kv_cache_rotation} only changes what an FP8 KV cache loses to "
                          "rounding (it is exact otherwise); add --kv-cache-dtype fp8 or drop --kv-cache-rotation.")
    if kv_cache_smoothing not in KV_CACHE_SMOOTHINGS:
        raise ConfigError(f"--kv-cache-smoothing {kv_cache_smoothing!r} is not supported; choose one of "
                          f"{', '.join(KV_CACHE_SMOOTHINGS)}.")
    if kv_cache_smoothing != "none" and kv_cache_dtype != "fp8":
        raise ConfigError(f"--kv-cache-smoothing {kv_cache_smoothing} only changes what an FP8 KV cache loses to "
                          "rounding (it is exact otherwise); add --kv-cache-dtype fp8 or drop --kv-cache-smoothing.")
    if kv_cache_scales not in (*KV_CACHE_SCALES, KV_CACHE_SCALES_AUTO):
        raise ConfigError(f"--kv-cache-scales {kv_cache_scales!r} is not supported; choose one of "
                          f"{', '.join(KV_CACHE_SCALES)} (one: 1.0 each; amax: calibrated per layer; amax_head: "
                          "per layer, each head brought within 2x of the layer's range; search: per layer, chosen "
                          "by the attention error; quantizer: those `trtopt quantize --kv-cache fp8` recorded), or "
                          "auto (quantizer where the source has them, else one).")
    quantizer_scales = _source_kv_scales(onnx_path) if kv_cache_dtype == "fp8" else None
    transformed = [flag for flag, value in (("--kv-cache-smoothing", kv_cache_smoothing),
                                            ("--kv-cache-rotation", kv_cache_rotation)) if value != "none"]
    kv_scales_note = ""
    change = f"{' and '.join(transformed)} {'changes' if len(transformed) == 1 else 'change'} them"
    if kv_cache_scales == KV_CACHE_SCALES_AUTO:
        kv_cache_scales = "quantizer" if quantizer_scales is not None and not transformed else "one"
        if quantizer_scales is not None and transformed:
            kv_scales_note = (f"the source's FP8 KV scales (trtopt quantize --kv-cache fp8) are for the K/V the model "
                              f"caches, and {change}: K/V scales 1.0; --kv-cache-scales amax calibrates them after "
                              "those")
    elif kv_cache_scales == "quantizer" and kv_cache_dtype == "fp8":
        if quantizer_scales is None:
            raise ConfigError(f"--kv-cache-scales quantizer: {onnx_path} has no FP8 KV scales; quantize it with "
                              "`trtopt quantize --kv-cache fp8`, or use --kv-cache-scales amax to calibrate here.")
        if transformed:
            raise ConfigError(f"--kv-cache-scales quantizer: the quantizer's scales are for the K/V the model caches, "
                              f"and {change}; use --kv-cache-scales amax (calibrated after them) or drop those "
                              "options.")
    if kv_cache_scales != "one" and kv_cache_dtype != "fp8":
        raise ConfigError(f"--kv-cache-scales {kv_cache_scales} sets the scales of an FP8 KV cache; add "
                          "--kv-cache-dtype fp8 or drop --kv-cache-scales.")
    if kv_cache_scales not in ("one", "quantizer") and tensor_parallel is not None:
        raise ConfigError(f"--kv-cache-scales {kv_cache_scales} calibrates on the whole final graph, and "
                          "--tensor-parallel leaves only the rank graph to run; build with --kv-cache-scales one "
                          "(scales of 1.0) or without --tensor-parallel.")
    calibrated = [f"{name}={value!r}" for name, value, off in (("kv_cache_smoothing", kv_cache_smoothing, "none"),
                                                                ("kv_cache_scales", kv_cache_scales, "one"))
                  if value != off and value != "quantizer"]
    if calibrated and kv_calibrator is None:
        raise ConfigError(f"{' and '.join(calibrated)} calibrate by running the graph: pass "
                          "kv_calibrator=trtopt.runtime.kv_calibration.kv_stats to build_plan (`trtopt build` does).")
    _check_out_dir(out_dir, source_dir, force)
    return BuildOptions(onnx_path=onnx_path, out_dir=out_dir, config_json=config_json,
                        generation_json=generation_json, limits=limits, tensor_parallel=tensor_parallel,
                        lm_head=lm_head, disable_passes=tuple(disable_passes), explain=explain,
                        kv_cache_dtype=kv_cache_dtype, kv_cache_rotation=kv_cache_rotation,
                        kv_cache_smoothing=kv_cache_smoothing, kv_cache_scales=kv_cache_scales,
                        kv_calibrator=kv_calibrator, kv_scales_note=kv_scales_note,
                        quantizer_kv_scales=quantizer_scales if kv_cache_scales == "quantizer" else None)


def _source_kv_scales(onnx_path: Path) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The FP8 KV scales `trtopt quantize --kv-cache fp8` recorded in the source's metadata, or None."""
    from trtopt.quantize.api import kv_cache_scales

    proto = onnx.load(str(onnx_path), load_external_data=False)
    scales = kv_cache_scales({p.key: p.value for p in proto.metadata_props})
    return None if scales is None else (tuple(scales[0]), tuple(scales[1]))


def fuse(options: BuildOptions, steps: _Steps) -> FusedGraph:
    """Load the source, run the fusion pipeline, and check the result is a plan graph the runtime can serve."""
    config_json = options.config_json
    with steps.step(f"loading {options.onnx_path.name}"):
        model = load_source(options.onnx_path)
    with steps.step("fusing (cleanup, attention, norms, MatMul+Add)"):
        report = optimize(
            model,
            dims=head_dims_from_config(config_json),
            block_size=options.limits.block_size,
            vocab_size=config_json.get("vocab_size"),
            probe_len=_probe_len(options.limits, config_json),
            horizontal=options.tensor_parallel is None,
            disable=options.disable_passes,
            max_positions=options.limits.max_model_len,
        )
    with steps.step("validating the plan graph"):
        _refuse_non_transformer(model, report, options.onnx_path)
        facts = model_facts(model, report.kind, config_json, options.generation_json)
        notes = tuple(config_disagreements(facts, config_json))
        check_signature(model, report.kind)
    if options.kv_cache_rotation != "none":
        odd = sorted({d for d in head_dims(model) if not is_power_of_two(d)})
        if odd:
            raise ConfigError(f"--kv-cache-rotation {options.kv_cache_rotation} needs a power-of-two "
                              f"head_dim (Sylvester's Hadamard matrix), and {options.onnx_path} has head_dim {', '.join(map(str, odd))}; build "
                              "without --kv-cache-rotation.")
    means = None
    if options.kv_cache_dtype == "fp8":
        if report.kind != "paged":
            raise ConfigError(f"--kv-cache-dtype fp8 sets the dtype of a KV cache, and {options.onnx_path} builds a "
                              f"{report.kind!r} plan without one; build it without --kv-cache-dtype.")
        means = smooth(options, model, steps)
    return FusedGraph(model=model, report=report, facts=facts, notes=notes, kv_means=means)


def smooth(options: BuildOptions, model: ir.Model, steps: _Steps) -> KvStats | None:
    """With --kv-cache-smoothing: calibrate every layer's mean key (and value) on the paged ``model`` while its
    pools still have the model's dtype, then subtract them before attention (in place). Runs in fuse, before the
    pools become FP8, and before shard and rotate: with the rotation the pools hold (k - b_k)·H; with
    --tensor-parallel the means are calibrated on the whole graph and shard gives each rank the rows of its KV heads
    (sharding/analysis.py, as it splits the K/V projections)."""
    if options.kv_cache_smoothing == "none":
        return None
    means = _calibrate(options, model, steps, "the K/V means", "--kv-cache-smoothing")
    smoothed = smooth_kv(model, means.k, means.v if options.kv_cache_smoothing == "kv" else None)
    assert smoothed == len(means.k), f"smoothed {smoothed} of {len(means.k)} attention layers"
    return means


def _calibrate(options: BuildOptions, model: ir.Model, steps: _Steps, what: str, flag: str,
               **candidates) -> KvStats:
    """Run options.kv_calibrator over builder/kv_calibration.py's windows of the source's tokenizer (a bar);
    ``candidates``: scale_candidates=, for --kv-cache-scales search."""
    from trtopt.quantize import data

    try:
        tokenizer = data.load_tokenizer(options.onnx_path.parent)
    except Exception as e:  # transformers raises OSError, ValueError... for a missing or broken tokenizer
        raise ConfigError(f"{flag} calibrates on text, and the tokenizer files next to {options.onnx_path.name} "
                          f"cannot be read ({type(e).__name__}); build the directory `trtopt export` wrote, or drop "
                          f"{flag}.") from e
    windows = calibration_windows(tokenizer, max_len=options.limits.max_model_len)
    assert options.kv_calibrator is not None, "validate_options requires a calibrator"
    with steps.bar(f"calibrating {what} ({windows.shape[0]} x {windows.shape[1]} tokens)", len(windows)) as advance:
        return options.kv_calibrator(model, windows, block_size=options.limits.block_size, on_window=advance,
                                     **candidates)


def shard(options: BuildOptions, fused: FusedGraph, steps: _Steps) -> ShardedGraph | None:
    """With --tensor-parallel N: rewrite ``fused.model`` in place into the rank graph (rank 0's weights)."""
    if options.tensor_parallel is None:
        return None
    assert fused.model is not None, "shard runs before write consumes the graph"
    with steps.step(f"sharding for {options.tensor_parallel} tensor-parallel rank(s)"):
        if fused.report.kind != "paged":
            raise ConfigError("--tensor-parallel shards paged (causal LM) plans only; build without it.")
        result = shard_structure(fused.model, options.tensor_parallel, lm_head=options.lm_head)
        if "horizontal_matmul" not in options.disable_passes:
            # Q/K/V and gate/up joined per rank, as fuse does for an unsharded plan (one GEMV each at decode, not
            # three and two: measured on 4xH200, the 8B shape's rank graph ran 57 GEMVs a step instead of 25).
            sources: dict = {}
            fused.report.counts["horizontal_matmul"] = fuse_horizontal_matmul(fused.model, sources=sources)
            result = join_fused(result, fused.model, sources)
        rank_facts = model_facts(fused.model, fused.report.kind, options.config_json, options.generation_json)
        check_signature(fused.model, fused.report.kind)
    return ShardedGraph(result=result, rank_facts=rank_facts)


def rotate(options: BuildOptions, fused: FusedGraph, steps: _Steps) -> None:
    """With --kv-cache-rotation hadamard(_kv): rotate q and k (and v) before every PagedAttention of ``fused.model``
    (the rank graph when sharded), in place.

    After shard, not in fuse: H acts within a head, so every rank takes the same H, and the sharding analysis would
    take MatMul(q, H), a MatMul by a constant 2-D weight, for the Q projection."""
    if options.kv_cache_rotation == "none":
        return
    assert fused.model is not None, "rotate runs before write consumes the graph"
    with steps.step(f"rotating q, k{' and v' if options.kv_cache_rotation == 'hadamard_kv' else ''} "
                    f"({options.kv_cache_rotation})"):
        rotated = rotate_qk(fused.model, values=options.kv_cache_rotation == "hadamard_kv")
    assert rotated == fused.facts.num_layers, f"rotated {rotated} of {fused.facts.num_layers} attention layers"


def store_fp8(options: BuildOptions, fused: FusedGraph, steps: _Steps) -> None:
    """With --kv-cache-dtype fp8: make the pools of ``fused.model`` (the rank graph when sharded) float8 E4M3, in
    place, with K/V scales of 1.0, or under --kv-cache-scales amax each layer's amax / 448, calibrated here on the
    final graph (after smoothing and rotation: what the pools will hold), its pools still in the model's dtype;
    under amax_head the heads are then multiplied by their power-of-two factors (kv_head_scales.py); under search a
    second calibration measures every candidate scale's attention error and keeps the least."""
    if options.kv_cache_dtype != "fp8":
        return
    assert fused.model is not None, "store_fp8 runs before write consumes the graph"
    k_scales = v_scales = None
    if options.kv_scales_note:
        fused.notes = (*fused.notes, options.kv_scales_note)
    if options.kv_cache_scales == "quantizer":
        assert options.quantizer_kv_scales is not None
        k_scales, v_scales = (list(s) for s in options.quantizer_kv_scales)
        if len(k_scales) != fused.facts.num_layers or len(v_scales) != fused.facts.num_layers:
            raise ConfigError(f"the source's FP8 KV scales cover {len(k_scales)} layers, the graph has "
                              f"{fused.facts.num_layers}; quantize this export again with --kv-cache fp8.")
        fused.kv_scales = k_scales, v_scales
    elif options.kv_cache_scales != "one":
        flag = f"--kv-cache-scales {options.kv_cache_scales}"
        fused.kv_amax = _calibrate(options, fused.model, steps, "the K/V scales", flag)
        k_scales, v_scales = fused.kv_amax.fp8_scales()  # the layer's amax: its largest head keeps the factor 1
        if options.kv_cache_scales == "search":
            candidates = fused.kv_amax.scale_candidates()
            fused.kv_amax = _calibrate(options, fused.model, steps, f"{len(candidates[0][0])} candidate K/V scales "
                                       "by their attention error", flag, scale_candidates=candidates)
            k_scales, v_scales = fused.kv_amax.searched_scales(candidates)
        fused.kv_scales = k_scales, v_scales
        if options.kv_cache_scales == "amax_head":
            with steps.step("scaling every KV head by a power of two"):
                scale_kv_heads(fused.model, *fused.kv_amax.head_factors())
    with steps.step("storing the KV pools as float8 E4M3"):
        use_fp8_kv_cache(fused.model, k_scales=k_scales, v_scales=v_scales)


def write(options: BuildOptions, fused: FusedGraph, sharded: ShardedGraph | None, steps: _Steps, *,
          start: float) -> BuildResult:
    """Write the plan dir: model.onnx (or rank{r}/ per rank), plan.json, the side files and fusion_report.json.
    ``fused.model`` is consumed (converted to the proto that is written)."""
    source_dir, out_dir = options.onnx_path.parent, options.out_dir
    means = fused.kv_means
    assert fused.model is not None, "write consumes the graph once"
    with steps.step("attaching the trtopt op functions"):
        proto = attach_functions(ir.to_proto(fused.model))
        if options.kv_cache_dtype == "fp8":
            attach_fp8_kv_function(proto)
        fused.model = None  # the proto holds the graph now; drop the IR copy before the weights are loaded
        # Weights the passes did not touch still point at the source's data file; pull them in so the plan
        # dir is self-contained (the locations were checked to stay inside the source dir on load).
        onnx.external_data_helper.load_external_data_for_model(proto, str(source_dir))
    with steps.step(f"writing {out_dir}"):
        _prepare_out_dir(out_dir)
        kv = dict(kv_cache_dtype=options.kv_cache_dtype, kv_cache_rotation=options.kv_cache_rotation,
                  kv_cache_smoothing=options.kv_cache_smoothing, kv_cache_scales=options.kv_cache_scales)
        config = PlanConfig(model=fused.facts, limits=options.limits, kind=fused.report.kind, **kv)
        if sharded is None:
            save_model(proto, out_dir)
        else:
            rank_config = PlanConfig(model=sharded.rank_facts, limits=options.limits, kind=fused.report.kind, **kv)
            write_rank_plans(proto, sharded.result, out_dir, rank_config)
            config = dataclasses.replace(config, parallel=parallel_config(sharded.result.layout, None))
        write_plan(out_dir, config)
        copied = copy_side_files(source_dir, out_dir)
        seconds = time.perf_counter() - start
        body = {
            **fused.report.to_dict(),
            **({"parallel": sharded.result.layout.to_dict()} if sharded is not None else {}),
            "source": str(options.onnx_path),
            "copied_files": copied,
            "seconds": round(seconds, 3),
            "explain": options.explain,
            "notes": list(fused.notes),
            **({"kv_smoothing": _calibration_report(means)} if means is not None else {}),
            **({"kv_scales": _scales_report(fused, per_head=options.kv_cache_scales == "amax_head")}
               if fused.kv_scales is not None else {}),
        }
        (out_dir / REPORT_FILE).write_text(json.dumps(body, indent=2) + "\n")
    layout = sharded.result.layout if sharded is not None else None
    return BuildResult(plan_dir=out_dir, config=config, report=fused.report, seconds=seconds, parallel=layout,
                       notes=fused.notes, kv_calibration=means.describe() if means is not None else "",
                       kv_scales=_describe_scales(fused, per_head=options.kv_cache_scales == "amax_head")
                       if fused.kv_scales is not None else "")


def _calibration_report(stats: KvStats) -> dict:
    return {"tokens": stats.tokens, "windows": stats.windows, "device": stats.device,
            "seconds": round(stats.seconds, 3)}


QUANTIZER_SCALES = "trtopt quantize --kv-cache fp8"  # where --kv-cache-scales quantizer's scales come from


def _scales_report(fused: FusedGraph, *, per_head: bool) -> dict:
    """fusion_report.json's kv_scales: the calibration, every layer's K and V scale, with amax_head every layer's
    head factors, with search every layer's candidates' attention errors relative to the best."""
    stats = fused.kv_amax
    assert fused.kv_scales is not None
    k, v = fused.kv_scales
    if stats is None:  # the source's quantizer calibrated them
        return {"source": QUANTIZER_SCALES, "k": k, "v": v}
    heads = stats.head_factors() if per_head else None
    return {**_calibration_report(stats), "k": k, "v": v,
            **({"k_head_factors": [f.tolist() for f in heads[0]], "v_head_factors": [f.tolist() for f in heads[1]]}
               if heads is not None else {}),
            **({"k_relative_errors": [np.round(e / max(e.min(), 1e-300), 4).tolist() for e in stats.k_errors],
                "v_relative_errors": [np.round(e / max(e.min(), 1e-300), 4).tolist() for e in stats.v_errors]}
               if stats.k_errors else {})}


def _describe_scales(fused: FusedGraph, *, per_head: bool) -> str:
    stats = fused.kv_amax
    assert fused.kv_scales is not None
    k, v = fused.kv_scales
    text = f"K {min(k):.3g}–{max(k):.3g}, V {min(v):.3g}–{max(v):.3g}"
    if stats is None:
        return f"{text}; from the source's quantizer ({QUANTIZER_SCALES})"
    if per_head:
        for name, factors in zip("KV", stats.head_factors()):
            flat = np.concatenate(factors)
            text += f"; {int((flat > 1).sum())} of {flat.size} {name} heads scaled (up to {int(flat.max())}x)"
    if stats.k_errors:
        gain = [float(e.max() / max(e.min(), 1e-300)) for e in stats.k_errors + stats.v_errors]
        text += f"; searched: the best of 16 cut a layer's attention error by up to {max(gain):.2f}x"
    return f"{text}; {stats.describe()}"


def build_plan(
    model_path: str | Path,
    out_dir: str | Path,
    *,
    limits: Limits | None = None,
    max_model_len: int | None = None,
    force: bool = False,
    explain: bool = False,
    progress: bool = True,
    tensor_parallel: int | None = None,
    lm_head: str = "replicated",
    disable_passes: Sequence[str] = (),
    kv_cache_dtype: str = "auto",
    kv_cache_rotation: str = "none",
    kv_cache_smoothing: str = "none",
    kv_cache_scales: str = KV_CACHE_SCALES_AUTO,
    kv_calibrator: KvCalibrator | None = None,
) -> BuildResult:
    """Fuse the model at ``model_path`` (a .onnx file or a directory holding model.onnx) into a plan dir.

    ``limits`` default to Limits() with max_model_len capped at the model's context; ``max_model_len`` overrides
    that field explicitly (and is then checked against the model's context).

    Raises ConfigError for bad limits, BuildError for unreadable/unsafe inputs and FusionError when a cache graph
    cannot be rewritten. ``explain`` keeps every unfused region in the report (they are always in
    fusion_report.json; the CLI prints them with --explain).

    ``tensor_parallel`` N: shard the fused graph for N ranks after every fusion (trtopt/builder/sharding/writer.py
    says what the plan dir then holds); FusionError when an attention layer cannot be split N ways. ``lm_head`` (with
    ``tensor_parallel`` only): "replicated" (default) or "vocab-parallel" (the head's weight split by vocabulary
    columns, its sampled rows all-gathered; docs/architecture.md §7b weighs the two).

    ``disable_passes`` names fusion passes to skip (``OPTIONAL_PASSES``: the performance fusions, for ablations);
    ConfigError for a name that is not one of them.

    ``kv_cache_dtype``: "auto" (the pools have the model's dtype) or "fp8" (float8_e4m3fn pools, per-layer K/V
    scales of 1.0 on the PagedAttention nodes; fusion_passes/paged_attention.py use_fp8_kv_cache); ConfigError for
    another value, or for "fp8" on a plan without a KV cache.

    ``kv_cache_rotation`` (with kv_cache_dtype "fp8" only): "none", "hadamard" (q and k multiplied by one
    orthonormal Hadamard matrix before each PagedAttention, exact in real arithmetic, so the FP8 pools hold k·H:
    fusion_passes/kv_rotation.py) or "hadamard_kv" (v too, and the output rotated back); ConfigError for another
    value, without "fp8", or for a head_dim that is not a power of two.

    ``kv_cache_smoothing`` (with kv_cache_dtype "fp8" only): "none", "k" (every layer's mean post-RoPE key per KV
    head and channel, calibrated on data.py's text at build time, subtracted before each PagedAttention: exact in
    real arithmetic, the softmax ignores a shift shared by all of a query's scores) or "kv" (the values' mean too,
    added back to the attention output); fusion_passes/kv_smoothing.py. With ``tensor_parallel`` each rank keeps the
    means of its KV heads. ConfigError for another value, without "fp8", or without the tokenizer files beside the
    source.

    ``kv_cache_scales`` (with kv_cache_dtype "fp8" only): "one" (every layer's K and V scale 1.0), "amax" (each
    layer's largest |k| and |v| over the calibration text, read on the final graph after smoothing and rotation,
    over 448: the largest calibrated value lands on E4M3's largest finite one) or "amax_head" (amax, and each KV
    head's k and v multiplied by a power of two that brings its amax within 2x of the layer's, divided back out of
    q and the output: exact in floating point; fusion_passes/kv_head_scales.py) or "search" (each layer's K and V
    scale the one of 16 candidates in [2, 4) x amax / 448 whose e4m3 rounding costs the attention output least on
    the calibration text; builder/kv_calibration.py SEARCH_STEPS) or "quantizer" (the per-layer scales that
    `trtopt quantize --kv-cache fp8` calibrated on the float model and recorded in the source: the amax of the K/V
    it caches / 448; not with smoothing or rotation, which change those K/V). ConfigError for another value,
    without "fp8", with ``tensor_parallel`` (the rank graph cannot run the whole model; "quantizer" can), or
    without the tokenizer files. The default "auto" is "quantizer" for an fp8 build of a source that has such
    scales and no smoothing or rotation, else "one" (with a note in the report when the source's were not taken).

    Both calibrations run the graph, which the builder cannot do itself (it never imports the runtime): pass
    ``kv_calibrator``, the runtime's ``trtopt.runtime.kv_calibration.kv_stats`` (`trtopt build` does); ConfigError
    when it is missing.
    """
    start = time.perf_counter()
    options = validate_options(model_path, out_dir, limits=limits, max_model_len=max_model_len, force=force,
                               explain=explain, tensor_parallel=tensor_parallel, lm_head=lm_head,
                               disable_passes=disable_passes, kv_cache_dtype=kv_cache_dtype,
                               kv_cache_rotation=kv_cache_rotation, kv_cache_smoothing=kv_cache_smoothing,
                               kv_cache_scales=kv_cache_scales, kv_calibrator=kv_calibrator)
    steps = _Steps(progress)
    with steps.run():
        fused = fuse(options, steps)
        sharded = shard(options, fused, steps)
        rotate(options, fused, steps)
        store_fp8(options, fused, steps)
        return write(options, fused, sharded, steps, start=start)
