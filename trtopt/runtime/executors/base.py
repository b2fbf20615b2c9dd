"""The executor contract (docs/architecture.md §5): one plan, several engines.

An executor owns the device buffers (weights, KV pools) and nothing else: no scheduling, no sampling. Every backend
subclasses `Executor` (torch_executor.py, ort_executor.py, trt_executor.py, tensor_parallel.py) and overrides only
the capabilities it has; callers read each one as a plain attribute, never probe for it with getattr/hasattr.
"""

from __future__ import annotations

import abc
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from trtopt.runtime.batch import StepInputs

if TYPE_CHECKING:
    from trtopt.builder.plan import PlanConfig
    from trtopt.runtime.executors.cuda_graphs import CaptureReport, StepGraphs


class Executor(abc.ABC):
    """Runs packed steps of one plan. Three abstract methods; every capability below has the default of an executor
    that lacks it, declared here once.

    State:
      plan: the plan it runs (a tensor-parallel executor: rank 0's). Set by every backend; not by test doubles.
      num_blocks: blocks in each layer's pool, the null block 0 included; 0 until allocate_kv_cache().

    Capabilities (default here → who overrides):
      resolves_placeholders: False → TorchExecutor, TensorParallelExecutor. True: execute() fills async scheduling's placeholder input ids
        from StepInputs.sampled_ids on its device, so the engine hands it the previous step's tokens without waiting
        for them. False: the engine fills them on the host before execute().
      last_greedy_tokens: None → TorchExecutor. int64 [N] on the device: the greedy argmax of the last execute()'s
        logits rows, when the step computed it itself (inside its CUDA graph: StepGraphs.argmax_in_graph); valid
        until the next execute(). It is the sampler's own function (kernels/argmax.py `greedy_argmax`), so the
        tokens are the ones the sampler would pick. None: the sampler takes the argmax itself if it needs it.
      graphs: None → TorchExecutor with cuda_graphs on CUDA; TensorParallelExecutor (rank 0's). The StepGraphs
        (cuda_graphs.py) that replay steps from CUDA graphs; None when every step runs eagerly.
      extra_outputs: empty → TorchExecutor, OrtExecutor. The graph outputs beyond the paged signature of the last
        (eager) step, by name: the layer-wise tensors `trtopt check --layerwise` marked (check/marking.py). Empty
        for a plan without them, and on TensorRT, which does not bind them.
      capture_graphs(*, max_num_seqs, max_num_tokens, max_logits=None): returns None, capturing nothing →
        TorchExecutor, TensorParallelExecutor: capture every bucket up to these limits now (at start-up, not inside
        the first steps) and return the CaptureReport, or None when the executor has no graphs.
      set_cuda_graphs(enabled): turns replay of the captured graphs on or off (eager steps); a no-op without graphs →
        TensorParallelExecutor (every rank together).
      shutdown(): a no-op → TensorParallelExecutor: release what outlives the object (worker processes, the
        process group). Idempotent; the executor runs no step after it.
    """

    plan: PlanConfig
    num_blocks: int = 0
    resolves_placeholders: bool = False
    last_greedy_tokens: torch.Tensor | None = None
    graphs: StepGraphs | None = None
    extra_outputs: Mapping[str, torch.Tensor] = MappingProxyType({})

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate every layer's pool as [num_blocks, 2, num_kv_heads, block_size, head_dim], zero-filled."""

    @abc.abstractmethod
    def execute(self, step: StepInputs) -> torch.Tensor:
        """Run one packed step; write new K/V into the pools in place; return logits [N, vocab] float32."""

    @abc.abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer's pool (copy-on-write)."""

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int,
                       max_logits: int | None = None) -> CaptureReport | None:
        """Capture the step graphs of every bucket up to these limits now; None: this executor has no graphs.

        max_logits: logits rows a step may ask for (default max_num_seqs); speculative verification asks for K+1 per
        sequence (cuda_graphs.graph_buckets)."""
        return None

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Replay the captured graphs (True) or run every step eagerly (False); a no-op without graphs."""
        if self.graphs is not None:
            self.graphs.enabled = enabled

    def shutdown(self) -> None:
        """Release what outlives this object (worker processes); idempotent. A no-op for a single-device executor."""
