"""Executors: one plan, several engines (docs/architecture.md §5). ``create_executor`` picks one by name.

Backends import lazily, so a missing optional dependency (tensorrt) only disables its own backend.
"""

from __future__ import annotations

from pathlib import Path

from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.builder.source import check_plan_model
from trtopt.errors import ConfigError
from trtopt.runtime.executors.base import Executor

BACKENDS = ("torch", "onnxruntime", "tensorrt")


def create_executor(backend: str, plan_dir: str | Path, plan: PlanConfig, *, device: str = "cpu",
                    num_blocks: int | None = None, cuda_graphs: bool = False,
                    compile_mode: str | None = None) -> Executor:
    """Build the executor `backend` ("torch", "onnxruntime" or "tensorrt") for a plan dir.

    device: "cpu" or "cuda" (onnxruntime: "cuda" selects the CUDA execution provider; tensorrt: always CUDA).
    num_blocks: when given, the KV pools are allocated now; otherwise call allocate_kv_cache() later.
    cuda_graphs: torch on CUDA only: replay every step from CUDA graphs at bucketed shapes (see cuda_graphs.py; LLMEngine.from_plan
    turns them on by default there).
    compile_mode: torch only, opt-in: run the converted graph through torch.compile in this mode ("default" or
    "max-autotune-no-cudagraphs"), specialised per step shape (torch_library.py); None = as converted.
    Raises BuildError when the plan's model file is unreadable or its external data leaves the plan dir.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if compile_mode is not None and backend != "torch":
        raise ConfigError(f"compile_mode={compile_mode!r} is a torch executor option; use backend='torch' or leave "
                          "compile_mode unset.")
    check_plan_model(Path(plan_dir) / MODEL_FILE)
    if plan.parallel is not None and plan.parallel.size > 1 and backend != "torch":
        # Their trtopt.AllReduce / AllGather would run the one-rank body: each rank's partial sum or its own block of
        # the vocabulary, silently wrong.
        raise ConfigError(f"{plan_dir} is one rank of a plan sharded for {plan.parallel.size}; only the torch backend "
                          "runs it (in a tensor-parallel group: LLM(plan, tensor_parallel_size=N)).")
    if backend == "torch":
        from trtopt.runtime.executors.torch_executor import TorchExecutor

        executor: Executor = TorchExecutor(plan_dir, plan, device=device, cuda_graphs=cuda_graphs,
                                           compile_mode=compile_mode)
    elif backend == "onnxruntime":
        from trtopt.runtime.executors.ort_executor import OrtExecutor

        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.startswith("cuda") else None
        executor = OrtExecutor(plan_dir, plan, providers=providers)
    else:  # tensorrt
        from trtopt.runtime.executors.trt_executor import TrtExecutor

        executor = TrtExecutor(plan_dir, plan)
    if num_blocks is not None:
        executor.allocate_kv_cache(num_blocks)
    return executor


__all__ = ["BACKENDS", "Executor", "create_executor"]
