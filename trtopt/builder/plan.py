"""The plan directory: ``plan.json`` schema, writer and reader (docs/architecture.md §1).

A plan dir holds the fused ``model.onnx``, ``plan.json`` (this schema), ``fusion_report.json`` and the
tokenizer files. ``plan.json`` is versioned; readers refuse versions they do not know.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from trtopt.errors import BuildError
from trtopt.signature import KV_CACHE_DTYPES, KV_CACHE_ROTATIONS, KV_CACHE_SCALES, KV_CACHE_SMOOTHINGS, kv_pool_dtype

PLAN_VERSION = 1
PLAN_FILE = "plan.json"
MODEL_FILE = "model.onnx"
REPORT_FILE = "fusion_report.json"


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the build inferred from the graph (and config.json when present)."""

    num_layers: int  # number of attention layers == number of kv_cache.{i} inputs
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    vocab_size: int
    dtype: str  # "float32" | "float16" | "bfloat16": the model's dtype (its pools' unless PlanConfig.kv_cache_dtype)
    eos_token_ids: tuple[int, ...]  # any of these ends a sequence
    bos_token_id: int | None = None
    model_type: str = ""  # e.g. "llama", "gpt2", "qwen2", "bert"; informational
    sliding_window: int = 0  # the widest window of any layer; 0 = none
    layer_sliding_windows: tuple[int, ...] = ()  # per attention layer (0 = global), e.g. Gemma-3's 5 local : 1 global
    max_position_embeddings: int = 0  # 0 = unknown


@dataclasses.dataclass(frozen=True)
class Limits:
    """Runtime limits baked into the plan (and into TensorRT optimization profiles)."""

    block_size: int = 16  # tokens per KV block
    max_num_tokens: int = 2048  # T: tokens per engine step
    max_num_seqs: int = 64  # S: sequences per engine step
    max_model_len: int = 2048  # prompt + output tokens of one sequence


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The tensor-parallel layout of a plan built with ``--tensor-parallel N`` (trtopt/builder/sharding/).

    The top-level plan dir holds plan.json with the global ModelFacts and ``rank`` None; each rank{r}/ sub-dir is a
    complete plan (model.onnx + plan.json) whose ModelFacts carry that rank's head counts and whose ``rank`` is r.
    """

    size: int  # ranks the plan was sharded for
    rank: int | None = None  # None in the top-level plan.json
    heads_per_rank: int = 0
    kv_heads_per_rank: int = 0
    kv_heads_replicated: bool = False  # num_kv_heads < size: a KV head lives on size/num_kv_heads ranks
    all_reduces_per_step: int = 0
    lm_head: str = "replicated"  # or "vocab-parallel": each rank holds vocab/N head columns (build --lm-head)


def rank_dir(plan_dir: str | Path, rank: int) -> Path:
    """The sub-dir holding rank ``rank``'s plan in a tensor-parallel plan dir."""
    return Path(plan_dir) / f"rank{rank}"


# PlanConfig's `trtopt build --kv-cache-*` fields: (the default, which plan.json omits, and the values it may hold).
_KV_OPTIONS = {"kv_cache_dtype": ("auto", KV_CACHE_DTYPES), "kv_cache_rotation": ("none", KV_CACHE_ROTATIONS),
               "kv_cache_smoothing": ("none", KV_CACHE_SMOOTHINGS), "kv_cache_scales": ("one", KV_CACHE_SCALES)}


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The contents of plan.json."""

    model: ModelFacts
    limits: Limits
    kind: str = "paged"  # "paged" (LLM with the §3 signature) or "flash" (no cache, e.g. an encoder)
    version: int = PLAN_VERSION
    parallel: ParallelConfig | None = None  # None: an unsharded plan
    # `trtopt build --kv-cache-dtype`: "auto" (the pools have the model's dtype) or "fp8" (float8_e4m3fn pools with
    # per-layer K/V scales on the PagedAttention nodes). Written to plan.json only when not "auto", so plans built
    # before it (and default plans) read and write the same file.
    kv_cache_dtype: str = "auto"
    # `trtopt build --kv-cache-rotation`: "none", or "hadamard" (q and k rotated by one Hadamard matrix before each
    # PagedAttention, so the pools hold k·H; fp8 plans only). Written only when not "none", like kv_cache_dtype.
    kv_cache_rotation: str = "none"
    # `trtopt build --kv-cache-smoothing`: "none", "k" (a calibrated per-layer mean subtracted from the keys before
    # each PagedAttention) or "kv" (from the values too, added back to the output); fp8 plans only. Written only when
    # not "none", like kv_cache_dtype.
    kv_cache_smoothing: str = "none"
    # `trtopt build --kv-cache-scales`: "one" (every layer's K/V scales 1.0) or "amax" (calibrated per layer on the
    # final graph); fp8 plans only. Written only when not "one", like kv_cache_dtype.
    kv_cache_scales: str = "one"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.limits.max_model_len // self.limits.block_size)

    @property
    def kv_pool_dtype(self) -> str:
        """The KV pools' dtype name: the model's, or float8_e4m3fn (trtopt/signature.py kv_pool_dtype)."""
        return kv_pool_dtype(self.model.dtype, self.kv_cache_dtype)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        for name, (default, _) in _KV_OPTIONS.items():
            if d[name] == default:
                del d[name]
        return json.dumps(d, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> PlanConfig:
        version = d.get("version")
        if version != PLAN_VERSION:
            raise BuildError(
                f"plan.json has version {version!r} but this trtopt reads version {PLAN_VERSION}; "
                "rebuild the plan with `trtopt build`."
            )
        model = dict(d["model"])
        model["eos_token_ids"] = tuple(model.get("eos_token_ids", ()))
        model["layer_sliding_windows"] = tuple(model.get("layer_sliding_windows", ()))
        parallel = ParallelConfig(**d["parallel"]) if d.get("parallel") else None
        kv = {name: d.get(name, default) for name, (default, _) in _KV_OPTIONS.items()}
        for name, (_, known) in _KV_OPTIONS.items():
            if kv[name] not in known:
                raise BuildError(f"plan.json has {name} {kv[name]!r}, which this trtopt does not know "
                                 f"({', '.join(known)}); rebuild the plan with `trtopt build`.")
        return cls(model=ModelFacts(**model), limits=Limits(**d["limits"]), kind=d.get("kind", "paged"),
                   version=version, parallel=parallel, **kv)

    def kv_options(self) -> dict[str, str]:
        """The `trtopt build --kv-cache-*` options the plan was built with (PlanConfig's fields of those names)."""
        return {name: getattr(self, name) for name in _KV_OPTIONS}


def write_plan(plan_dir: str | Path, config: PlanConfig) -> Path:
    path = Path(plan_dir) / PLAN_FILE
    path.write_text(config.to_json() + "\n")
    return path


def read_plan(plan_dir: str | Path) -> PlanConfig:
    plan_dir = Path(plan_dir)
    path = plan_dir / PLAN_FILE
    if not path.is_file():
        raise BuildError(f"{plan_dir} is not a plan directory (no {PLAN_FILE}); create one with `trtopt build MODEL -o {plan_dir}`.")
    try:
        data = json.loads(path.read_text())
        return PlanConfig.from_dict(data)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BuildError(f"{path} is corrupt ({e}); rebuild the plan with `trtopt build`.") from e
