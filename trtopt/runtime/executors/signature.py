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
# What the pools may also be (PlanConfig.kv_pool_dtype): float8_e4m3fn in a plan built with --kv-cache-dtype fp8.
TORCH_POOL_DTYPES = {**TORCH_DTYPES, signature.FP8_KV_DTYPE: getattr(torch, signature.FP8_KV_DTYPE)}
# numpy has no float8: the onnxruntime executor holds an FP8 pool as its bytes (in an ORT-allocated float8 OrtValue).
NUMPY_POOL_DTYPES = {**NUMPY_DTYPES, signature.FP8_KV_DTYPE: np.uint8}
FP8_MIN_CAPABILITY = (8, 9)  # CUDA compute capability with float8 E4M3 conversions (Ada, Hopper and newer)


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


def pool_dtype(plan: PlanConfig, supported: dict, *, device: torch.device | str = "cpu") -> object:
    """The dtype of the plan's KV pools (plan.kv_pool_dtype) in ``supported``'s terms; ConfigError where this
    executor, or a CUDA ``device`` older than compute capability 8.9, cannot hold an FP8 pool (the CPU always can)."""
    if plan.kv_cache_dtype == "auto":
        return kv_dtype(plan, supported)
    name = plan.kv_pool_dtype
    if name not in supported:
        raise ConfigError(
            f"the plan's KV pools are {name} (built with --kv-cache-dtype {plan.kv_cache_dtype}), which this executor "
            f"cannot hold (it takes {sorted(supported)}); run it with the torch backend, or rebuild the plan with "
            "--kv-cache-dtype auto."
        )
    device = torch.device(device)
    if name == signature.FP8_KV_DTYPE and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"the plan's KV pools are float8 E4M3 (--kv-cache-dtype fp8), which needs a CUDA device of compute "
                f"capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer; {device} is "
                f"{'.'.join(map(str, capability))}. Rebuild the plan with --kv-cache-dtype auto, or run it on the CPU."
            )
    return supported[name]


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
