"""The paged signature (trtopt/signature.py) as the executors see it: the plan check, pool shapes, dtype maps."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from trtopt import signature
from trtopt.builder.plan import PlanConfig
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import StepInputs

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def check_paged_plan(plan: PlanConfig, plan_dir: str | Path, input_names: Sequence[str],
                     output_names: Sequence[str]) -> None:
    """Raise BuildError unless the graph has exactly the I/O an executor of this plan will feed and read."""
    if plan.kind != "paged":
        raise ConfigError(
            f"{plan_dir} is a {plan.kind!r} plan (no KV cache); the LLM executors run 'paged' plans only. "
            "Build a causal LM with a KV cache, or run this encoder plan on onnxruntime directly."
        )
    layers = plan.model.num_layers
    expected_in = set(signature.input_names(layers))
    expected_out = set(signature.output_names(layers))
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
    return signature.kv_dims(num_blocks, m.num_kv_heads, plan.limits.block_size, m.head_dim)


def step_tensors(step: StepInputs) -> dict[str, torch.Tensor]:
    """The graph feeds of one step by name, with the dtypes of §3 (a wrong dtype is a caller bug)."""
    feeds = {spec.name: getattr(step, spec.name) for spec in signature.STEP_INPUTS}
    for spec in signature.STEP_INPUTS:
        want = getattr(torch, spec.dtype)
        assert feeds[spec.name].dtype == want, f"StepInputs.{spec.name} must be {want}, got {feeds[spec.name].dtype}"
    return feeds
