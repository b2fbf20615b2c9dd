"""The executor contract (docs/architecture.md §5): one plan, several engines.

An executor owns the device buffers (weights, KV pools) and nothing else: no scheduling, no sampling.

Optional attributes the engine reads with getattr: `resolves_placeholders` (True: it fills async scheduling's
placeholder ids from StepInputs.sampled_ids on its device) and `last_greedy_tokens` (the greedy argmax of the last
step's logits rows when the step computed it on the device, e.g. inside its CUDA graph; None otherwise). The argmax
is the sampler's own function, so the tokens are the ones the sampler would pick.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from trtopt.runtime.batch import StepInputs


class Executor(Protocol):
    num_blocks: int  # blocks in each layer's pool, including the null block 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate every layer's pool as [num_blocks, 2, num_kv_heads, block_size, head_dim], zero-filled."""

    def execute(self, step: StepInputs) -> torch.Tensor:
        """Run one packed step; write new K/V into the pools in place; return logits [N, vocab] float32."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer's pool (copy-on-write)."""
