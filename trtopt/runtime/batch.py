"""Typed stage contracts of the runtime (DESIGN.md §3, §6).

StepInputs is the packed paged signature of one engine step, exactly the graph inputs of a built plan
(minus the KV pools, which the executor owns).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class StepInputs:
    """The §3 tensors of one step. All on CPU; the executor moves them to its device."""

    input_ids: torch.Tensor  # int64 [1, T]: all scheduled tokens, sequences concatenated
    position_ids: torch.Tensor  # int64 [1, T]: absolute position of each token in its sequence
    block_tables: torch.Tensor  # int32 [S, max_blocks_per_seq]: physical block ids, padded with 0 (null block)
    seq_lens: torch.Tensor  # int32 [S]: tokens of each sequence in the cache *after* this step
    query_start_loc: torch.Tensor  # int32 [S+1]: sequence s owns rows [qsl[s], qsl[s+1]) of the T tokens
    slot_mapping: torch.Tensor  # int64 [T]: block*block_size+offset where each token's K/V goes; -1 = no write
    logits_indices: torch.Tensor  # int64 [N]: rows of the T hidden states projected to logits

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
