"""The one Triton launch of trtopt.runtime.batch.fill_placeholders_ (imported lazily, only for CUDA tensors)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher

BLOCK = 1024


@triton.jit
def _fill_placeholders(Ids, Sampled, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(Ids + offs, mask=offs < n, other=0)
    hole = (offs < n) & (ids < 0)
    tokens = tl.load(Sampled + (-1 - ids), mask=hole, other=0)
    tl.store(Ids + offs, tokens, mask=hole)


def fill_placeholders_triton(input_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """In place on contiguous int64 CUDA tensors: each id −1−k becomes sampled_ids[k]; returns input_ids."""
    n = input_ids.numel()
    if n:
        launcher.launch(_fill_placeholders, (-(-n // BLOCK),), input_ids, sampled_ids, n, BLOCK=BLOCK, num_warps=4)
    return input_ids
