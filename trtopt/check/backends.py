"""Which backends can run a plan here, and why the others cannot (reported, never faked)."""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from trtopt.builder.plan import PlanConfig
from trtopt.runtime.executors.signature import NUMPY_DTYPES, TORCH_DTYPES


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run a plan: an executor kind on a device."""

    name: str  # as the CLI and the report say it, e.g. "onnxruntime-cpu"
    executor: str  # create_executor's backend: "torch" | "onnxruntime" | "tensorrt"
    device: str  # "cpu" | "cuda"


BACKENDS = (
    Backend("torch-cpu", "torch", "cpu"),
    Backend("torch-cuda", "torch", "cuda"),
    Backend("onnxruntime-cpu", "onnxruntime", "cpu"),
    Backend("onnxruntime-cuda", "onnxruntime", "cuda"),
    Backend("tensorrt", "tensorrt", "cuda"),
)
BY_NAME = {b.name: b for b in BACKENDS}


def unavailable_reason(backend: Backend, plan: PlanConfig) -> str | None:
    """None when ``backend`` can run ``plan`` on this machine, else why not."""
    dtype = plan.model.dtype
    if backend.executor == "tensorrt":
        if importlib.util.find_spec("tensorrt") is None:
            return "not installed (the `tensorrt` package)"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None
    if backend.executor == "onnxruntime":
        if dtype not in NUMPY_DTYPES:
            return f"onnxruntime cannot feed {dtype} KV pools from numpy"
        if backend.device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return "not installed (onnxruntime-gpu: no CUDAExecutionProvider)"
        return None
    if dtype not in TORCH_DTYPES:
        return f"torch cannot hold {dtype} KV pools"
    if backend.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return None
