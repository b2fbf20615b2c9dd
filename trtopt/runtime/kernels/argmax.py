"""Greedy argmax over a step's logits, [N, V] → [N] int64: torch.argmax's answer (the first index of the largest
value; NaN counts as larger than anything, the first NaN wins), in two Triton launches on CUDA.

Why not `logits.argmax(-1)`: at batch 1 torch's reduction kernel took 28 µs per decode step of the 1.24B plan on the
H200 (one row of 128,256 logits; GPU_E2E.md's profile), 2.6% of the step's kernel time. Here the row is cut into
CHUNK-wide pieces reduced in parallel (argmax_triton.py), and a second launch picks the winner among the pieces'
winners.

Ties and NaN follow torch exactly because values are compared as integer keys with a total order: a float's bits
mapped so that integer order is float order (-inf lowest, +inf highest, −0 equal to +0), every NaN mapped above
+inf, padding below everything; each piece keeps its first maximal key, the second launch the first maximal piece.
"""

from __future__ import annotations

import functools

import torch


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None, *, kernel: bool = True) -> torch.Tensor:
    """[N, V] → [N] int64, torch.argmax's answer: the two-launch kernel on CUDA for rows long enough to split,
    torch.argmax otherwise (the CPU, short rows, or no Triton). out: an int64 [N] tensor to write the answer into
    (a CUDA graph's fixed buffer), returned. kernel=False: torch.argmax always (the callers' `argmax_kernel`
    option: Sampler, StepGraphs, TorchExecutor; benchmarks turn it off to time torch.argmax in the same run,
    gpu_e2e.py's argmax row)."""
    if kernel and logits.is_cuda and logits.dim() == 2 and logits.shape[-1] > _MIN_SPLIT \
            and logits.stride(-1) == 1:
        launch = _kernel()
        if launch is not None:
            return launch(logits, out=out)
    if out is None:
        return logits.argmax(dim=-1)
    return torch.argmax(logits, dim=-1, out=out)


_MIN_SPLIT = 4096  # shorter rows fit one program: torch's own kernel is as good


@functools.cache
def _kernel():
    try:
        from trtopt.runtime.kernels.argmax_triton import argmax_triton
    except ImportError:  # no Triton: torch.argmax is always correct
        return None
    return argmax_triton
