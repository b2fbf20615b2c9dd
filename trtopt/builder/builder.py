"""`trtopt build`: run the fusion pipeline on an exported model and write the plan dir (docs/architecture.md §1).

source model (dir or .onnx) ──load──▶ onnx-ir model ──optimize──▶ fused graph ──validate──▶ plan dir
                                                                                            model.onnx (+ .data)
                                                                                            plan.json
                                                                                            fusion_report.json
                                                                                            tokenizer + config files
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Iterator, Sequence

import onnx
import onnx_ir as ir

from trtopt.builder.model_facts import (
    config_disagreements,
    context_length,
    head_dims_from_config,
    model_facts,
    read_json,
)
from trtopt.builder.plan import MODEL_FILE, REPORT_FILE, Limits, PlanConfig, write_plan
from trtopt.builder.signature import check_signature
from trtopt.builder.source import load_source, resolve_model_path
from trtopt.errors import BuildError, ConfigError
from trtopt.fusion_passes.pipeline import OPTIONAL_PASSES, FusionReport, optimize
from trtopt.fusion_passes.tensor_parallel import LM_HEAD_MODES, ParallelLayout
from trtopt.fusion_passes.trace import Trace

# Files copied from next to the source model so the plan dir is self-contained for the runtime and detokenizer.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
BLOCK_SIZES = (8, 16, 32, 64, 128)  # the kernels' tested sizes; powers of two keep slot math cheap
EXTERNAL_DATA_FILE = "model.onnx.data"
# Above this many weight bytes the plan's weights go to model.onnx.data (protobuf cannot hold 2 GiB).
_EXTERNAL_DATA_THRESHOLD = 256 << 20


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `trtopt build` produced."""

    plan_dir: Path
    config: PlanConfig
    report: FusionReport
    seconds: float
    parallel: ParallelLayout | None = None  # the tensor-parallel layout, when built with tensor_parallel
    notes: tuple[str, ...] = ()  # where config.json and the graph disagreed (the graph won)


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


def _save(proto: onnx.ModelProto, out_dir: Path) -> Path:
    path = out_dir / MODEL_FILE
    weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
    if weight_bytes > _EXTERNAL_DATA_THRESHOLD:
        onnx.save(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=EXTERNAL_DATA_FILE,
            size_threshold=1024,
        )
        (out_dir / EXTERNAL_DATA_FILE).chmod(0o644)  # onnx writes it 0600; servers often run as another user
    else:
        onnx.save(proto, path)
    # The full checker (with shape inference of the function bodies) reads the saved file, so 2 GiB models work.
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise BuildError(f"the fused graph failed the ONNX checker: {str(e)[:800]}. Please report this build.") from e
    return path


def _copy_side_files(source_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out_dir / name)
            copied.append(name)
    return copied


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


def _fit_limits(limits: Limits | None, max_model_len: int | None, config: dict) -> Limits:
    """The given limits, or the defaults with max_model_len capped at the model's context (None = default 2048).

    An explicit max_model_len beyond the context config.json states is a ConfigError.
    """
    limits = limits or Limits()
    context = context_length(config)
    if max_model_len is not None:
        if context and max_model_len > context:
            raise ConfigError(
                f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {context}; lower it."
            )
        return dataclasses.replace(limits, max_model_len=max_model_len)
    if context and limits.max_model_len > context:
        return dataclasses.replace(limits, max_model_len=context)
    return limits


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
) -> BuildResult:
    """Fuse the model at ``model_path`` (a .onnx file or a directory holding model.onnx) into a plan dir.

    ``limits`` default to Limits() with max_model_len capped at the model's context; ``max_model_len`` overrides
    that field explicitly (and is then checked against the model's context).

    Raises ConfigError for bad limits, BuildError for unreadable/unsafe inputs and FusionError when a cache graph
    cannot be rewritten. ``explain`` keeps every unfused region in the report (they are always in
    fusion_report.json; the CLI prints them with --explain).

    ``tensor_parallel`` N: shard the fused graph for N ranks after every fusion (trtopt/builder/sharding.py says what
    the plan dir then holds); FusionError when an attention layer cannot be split N ways. ``lm_head`` (with
    ``tensor_parallel`` only): "replicated" (default) or "vocab-parallel" (the head's weight split by vocabulary
    columns, its sampled rows all-gathered; docs/architecture.md §7b weighs the two).

    ``disable_passes`` names fusion passes to skip (``OPTIONAL_PASSES``: the performance fusions, for ablations);
    ConfigError for a name that is not one of them.
    """
    start = time.perf_counter()
    onnx_path = resolve_model_path(Path(model_path))
    source_dir = onnx_path.parent
    out_dir = Path(out_dir)
    config_json = read_json(source_dir / "config.json")
    generation_json = read_json(source_dir / "generation_config.json")
    limits = _fit_limits(limits, max_model_len, config_json)
    validate_limits(limits)
    if tensor_parallel is not None and (not isinstance(tensor_parallel, int) or tensor_parallel < 1):
        raise ConfigError(f"--tensor-parallel must be a positive integer, got {tensor_parallel!r}.")
    if lm_head not in LM_HEAD_MODES:
        raise ConfigError(f"--lm-head {lm_head!r}: choose one of {', '.join(LM_HEAD_MODES)}.")
    if lm_head != "replicated" and tensor_parallel is None:
        raise ConfigError(f"--lm-head {lm_head} splits the LM head over tensor-parallel ranks; add --tensor-parallel N.")
    unknown = sorted(set(disable_passes) - set(OPTIONAL_PASSES))
    if unknown:
        raise ConfigError(f"--disable-pass {', '.join(unknown)}: no such optional pass; choose from "
                          f"{', '.join(OPTIONAL_PASSES)}.")
    _check_out_dir(out_dir, source_dir, force)

    steps = _Steps(progress)
    with steps.run():
        with steps.step(f"loading {onnx_path.name}"):
            model = load_source(onnx_path)
        with steps.step("fusing (cleanup, attention, norms, MatMul+Add)"):
            report = optimize(
                model,
                dims=head_dims_from_config(config_json),
                block_size=limits.block_size,
                vocab_size=config_json.get("vocab_size"),
                probe_len=_probe_len(limits, config_json),
                horizontal=tensor_parallel is None,
                disable=tuple(disable_passes),
                max_positions=limits.max_model_len,
            )
        with steps.step("validating the plan graph"):
            _refuse_non_transformer(model, report, onnx_path)
            facts = model_facts(model, report.kind, config_json, generation_json)
            notes = tuple(config_disagreements(facts, config_json))
            if facts.max_position_embeddings and limits.max_model_len > facts.max_position_embeddings:
                raise ConfigError(
                    f"--max-model-len {limits.max_model_len} exceeds the model's max_position_embeddings "
                    f"{facts.max_position_embeddings}; lower it."
                )
            check_signature(model, report.kind)
        shard = None
        if tensor_parallel is not None:
            from trtopt.fusion_passes.tensor_parallel import shard_structure

            with steps.step(f"sharding for {tensor_parallel} tensor-parallel rank(s)"):
                if report.kind != "paged":
                    raise ConfigError("--tensor-parallel shards paged (causal LM) plans only; build without it.")
                shard = shard_structure(model, tensor_parallel, lm_head=lm_head)
                rank_facts = model_facts(model, report.kind, config_json, generation_json)
                check_signature(model, report.kind)
        with steps.step("attaching the trtopt op functions"):
            from trtopt.plugins import attach_functions

            proto = attach_functions(ir.to_proto(model))
            del model
            # Weights the passes did not touch still point at the source's data file; pull them in so the plan
            # dir is self-contained (the locations were checked to stay inside the source dir on load).
            onnx.external_data_helper.load_external_data_for_model(proto, str(source_dir))
        with steps.step(f"writing {out_dir}"):
            _prepare_out_dir(out_dir)
            config = PlanConfig(model=facts, limits=limits, kind=report.kind)
            if shard is None:
                _save(proto, out_dir)
            else:
                from trtopt.builder.sharding import parallel_config, write_rank_plans

                rank_config = PlanConfig(model=rank_facts, limits=limits, kind=report.kind)
                write_rank_plans(proto, shard, out_dir, rank_config, _save)
                config = dataclasses.replace(config, parallel=parallel_config(shard.layout, None))
            write_plan(out_dir, config)
            copied = _copy_side_files(source_dir, out_dir)
            seconds = time.perf_counter() - start
            body = {
                **report.to_dict(),
                **({"parallel": shard.layout.to_dict()} if shard is not None else {}),
                "source": str(onnx_path),
                "copied_files": copied,
                "seconds": round(seconds, 3),
                "explain": explain,
                "notes": list(notes),
            }
            (out_dir / REPORT_FILE).write_text(json.dumps(body, indent=2) + "\n")
    layout = shard.layout if shard is not None else None
    return BuildResult(plan_dir=out_dir, config=config, report=report, seconds=seconds, parallel=layout, notes=notes)
