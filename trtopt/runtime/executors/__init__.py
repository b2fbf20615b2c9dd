"""Executors: one plan, several engines (docs/architecture.md §5). ``create_executor`` opens any of them.

Every backend subclasses base.Executor: torch_executor.py, ort_executor.py, trt_executor.py, and tensor_parallel.py
(the torch executor over N ranks, with shm_broadcast.py, its per-step channel). Backends import lazily, so a
missing optional dependency (tensorrt) only disables its own backend.
"""

from __future__ import annotations

from pathlib import Path

from trtopt.builder.plan import MODEL_FILE, PlanConfig, rank_dir, read_plan
from trtopt.builder.source import check_plan_model
from trtopt.errors import ConfigError
from trtopt.runtime.config import NodeConfig
from trtopt.runtime.executors.base import Executor

BACKENDS = ("torch", "onnxruntime", "tensorrt")


def create_executor(backend: str, plan_dir: str | Path, plan: PlanConfig | None = None, *, device: str = "cpu",
                    num_blocks: int | None = None, cuda_graphs: bool = False, compile_mode: str | None = None,
                    tensor_parallel_size: int | None = None, argmax_in_graph: bool = True,
                    nodes: NodeConfig | None = None) -> Executor:
    """Open the executor `backend` ("torch", "onnxruntime" or "tensorrt") for a plan dir; `executor.plan` is the
    plan it runs.

    plan: plan_dir's plan, as read by the caller: that one dir runs in this process (one rank's dir of a sharded
    plan included). None: read it here, and open a plan dir built with --tensor-parallel N as N ranks (a
    TensorParallelExecutor over worker processes; call shutdown() when done), or as rank0/ alone when N is 1.
    tensor_parallel_size: with plan=None only: the ranks asked for (None = the plan's own size); ConfigError when the
    plan was not built for that many.
    nodes: with plan=None only: a group over several hosts, this process being node 0 (the driver); node R > 0 runs
    tensor_parallel.run_worker_node instead. None = one host.
    device: "cpu" or "cuda" (onnxruntime: "cuda" selects the CUDA execution provider; tensorrt: always CUDA; tensor
    parallel on CUDA: rank r on cuda:r).
    num_blocks: when given, the KV pools are allocated now; otherwise call allocate_kv_cache() later.
    cuda_graphs: torch on CUDA only: replay every step from CUDA graphs at bucketed shapes (see cuda_graphs.py;
    LLMEngine.from_plan turns them on by default there).
    argmax_in_graph: torch on one device: each step graph also fills the placeholders and takes the greedy argmax
    (the default); False launches both from Python between replays (TorchExecutor; benchmarks' A/B).
    compile_mode: torch on one device only, opt-in: run the converted graph through torch.compile in this mode
    ("default" or "max-autotune-no-cudagraphs"), specialised per step shape (torch_library.py); None = as converted.
    Raises BuildError when the plan's model file is unreadable or its external data leaves the plan dir.
    """
    if plan is None:
        top_dir = plan_dir
        plan, plan_dir, size = _resolve_plan(top_dir, tensor_parallel_size)
        _check_tensor_parallel_backend(backend, size)
        nodes = nodes or NodeConfig()
        nodes.ranks_per_node(size)  # ConfigError when the ranks do not split over the nodes
        if size > 1:
            return _open_tensor_parallel(top_dir, size, device=device, num_blocks=num_blocks, cuda_graphs=cuda_graphs,
                                         compile_mode=compile_mode, argmax_in_graph=argmax_in_graph, nodes=nodes)
    else:
        assert tensor_parallel_size is None, "tensor_parallel_size resolves a plan dir: pass it with plan=None"
        assert nodes is None, "nodes resolves a plan dir: pass it with plan=None"
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
                                           compile_mode=compile_mode, argmax_in_graph=argmax_in_graph)
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


def _open_tensor_parallel(plan_dir: str | Path, size: int, *, device: str, num_blocks: int | None,
                          cuda_graphs: bool, compile_mode: str | None, argmax_in_graph: bool,
                          nodes: NodeConfig) -> Executor:
    if compile_mode is not None:
        raise ConfigError(f"compile_mode={compile_mode!r} runs one device; leave it unset with "
                          f"tensor_parallel_size={size}.")
    if not argmax_in_graph:  # the ranks' executors keep the default
        raise ConfigError(f"argmax_in_graph=False is a one-device option; leave it unset with "
                          f"tensor_parallel_size={size}.")
    from trtopt.runtime.executors.tensor_parallel import TensorParallelExecutor

    assert nodes.node_rank == 0, "node R > 0 runs tensor_parallel.run_worker_node, not an executor"
    executor = TensorParallelExecutor(plan_dir, size, device=device, cuda_graphs=cuda_graphs, nnodes=nodes.nnodes,
                                      master_addr=nodes.master_addr, master_port=nodes.master_port)
    if num_blocks is not None:
        executor.allocate_kv_cache(num_blocks)
    return executor


def _resolve_plan(plan_dir: str | Path, tensor_parallel_size: int | None) -> tuple[PlanConfig, Path, int]:
    """(the plan rank 0 runs, its dir, the group size) for a plan dir and the size asked for.

    An unsharded plan runs at size 1 only; a sharded one at its own size (None = take it). ConfigError otherwise.
    """
    top = read_plan(plan_dir)
    if tensor_parallel_size is not None and (not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1):
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}.")
    if top.parallel is None:
        if tensor_parallel_size not in (None, 1):
            raise ConfigError(
                f"{plan_dir} is not sharded; build it for {tensor_parallel_size} ranks with "
                f"`trtopt build MODEL -o PLAN --tensor-parallel {tensor_parallel_size}`."
            )
        return top, Path(plan_dir), 1
    size = top.parallel.size
    if tensor_parallel_size not in (None, size):
        raise ConfigError(
            f"{plan_dir} was sharded for {size} ranks but tensor_parallel_size={tensor_parallel_size}; pass "
            f"{size}, or rebuild with `trtopt build ... --tensor-parallel {tensor_parallel_size}`."
        )
    first = rank_dir(plan_dir, 0)
    return read_plan(first), first, size


def _check_tensor_parallel_backend(backend: str, size: int) -> None:
    if size > 1 and backend != "torch":
        raise ConfigError(
            f"tensor_parallel_size={size} runs on the torch backend only: onnxruntime and TensorRT would run "
            "trtopt.AllReduce as its one-rank Identity body (trtopt/plugins/all_reduce/trt_plugin.py says how "
            "TensorRT-LLM's NCCL plugin would take it). Use --backend torch."
        )


__all__ = ["BACKENDS", "Executor", "create_executor"]
