"""The paged signature (DESIGN.md §3) as the executors see it: names, checks, and dtype maps."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from trtopt.build.plan import PlanConfig
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import StepInputs

# StepInputs field == graph input name, in the order of DESIGN.md §3.
STEP_INPUT_NAMES = (
    "input_ids", "position_ids", "block_tables", "seq_lens", "query_start_loc", "slot_mapping", "logits_indices",
)
LOGITS = "logits"

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def kv_input(layer: int) -> str:
    return f"kv_cache.{layer}"


def kv_output(layer: int) -> str:
    return f"kv_cache_out.{layer}"


def check_paged_plan(plan: PlanConfig, plan_dir: str | Path, input_names: Sequence[str],
                     output_names: Sequence[str]) -> None:
    """Raise BuildError unless the graph has exactly the I/O an executor of this plan will feed and read."""
    if plan.kind != "paged":
        raise ConfigError(
            f"{plan_dir} is a {plan.kind!r} plan (no KV cache); the LLM executors run 'paged' plans only. "
            "Build a causal LM with a KV cache, or run this encoder plan on onnxruntime directly."
        )
    layers = plan.model.num_layers
    expected_in = set(STEP_INPUT_NAMES) | {kv_input(i) for i in range(layers)}
    expected_out = {LOGITS} | {kv_output(i) for i in range(layers)}
    missing_in = sorted(expected_in - set(input_names))
    missing_out = sorted(expected_out - set(output_names))
    extra_in = sorted(set(input_names) - expected_in)
    if missing_in or missing_out or extra_in:
        raise BuildError(
            f"{plan_dir}/model.onnx does not have the paged signature of plan.json ({layers} layers): "
            f"missing inputs {missing_in}, missing outputs {missing_out}, unexpected inputs {extra_in}. "
            "Rebuild the plan with `trtopt build`."
        )


def kv_dtype(plan: PlanConfig, supported: dict) -> object:
    dtype = plan.model.dtype
    if dtype not in supported:
        raise ConfigError(
            f"the plan's KV dtype {dtype!r} is not supported by this executor (supported: {sorted(supported)}); "
            "use the torch backend or rebuild the plan in float32/float16."
        )
    return supported[dtype]


def kv_shape(plan: PlanConfig, num_blocks: int) -> tuple[int, int, int, int, int]:
    """[num_blocks, 2, Hkv, block_size, D], block 0 being the null block."""
    if num_blocks < 2:
        raise ConfigError(f"num_blocks must be >= 2 (block 0 is the reserved null block); got {num_blocks}.")
    m = plan.model
    return (num_blocks, 2, m.num_kv_heads, plan.limits.block_size, m.head_dim)


def step_tensors(step: StepInputs) -> dict[str, torch.Tensor]:
    """The graph feeds of one step by name, with the dtypes of §3 (a wrong dtype is a caller bug)."""
    feeds = {name: getattr(step, name) for name in STEP_INPUT_NAMES}
    for name, tensor in feeds.items():
        want = torch.int64 if name in ("input_ids", "position_ids", "slot_mapping", "logits_indices") else torch.int32
        assert tensor.dtype == want, f"StepInputs.{name} must be {want}, got {tensor.dtype}"
    return feeds
