"""The proposer contract of speculative decoding (docs/architecture.md §6, "Speculative decoding").

Each step, after the scheduler has reserved `num_lookahead` draft slots for every decoding sequence, the
proposer guesses up to that many next tokens per sequence. The target then scores the last committed token and
every draft token in one step (K+1 logits rows) and rejection.verify keeps the longest accepted prefix plus one
token drawn after it. A proposer sees the batch (block tables included: a draft model writes its K/V there) and
the requests; it never changes either.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import torch

from trtopt.runtime.batch import ScheduledBatch
from trtopt.runtime.executors.cuda_graphs import CaptureReport
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler


@dataclasses.dataclass
class Proposal:
    """Draft tokens for one sequence and the distribution each was drawn from."""

    token_ids: list[int]  # 1 <= len <= the sequence's num_lookahead
    # [len(token_ids), vocab] float32: q_j, the processed draft distribution token j was drawn from (sampler's
    # processed_probs). None for a deterministic proposer (n-gram): q is one-hot at the proposed token.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, batch: ScheduledBatch, requests: Mapping[str, Request], sampler: Sampler) -> dict[str, Proposal]:
        """Proposals for the sequences of `batch` with num_lookahead > 0 (an id may be left out: no guess).

        Called once per engine step, before the target runs, for every non-empty batch.
        """

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The target's pool was (re)allocated with num_blocks blocks; a draft with its own pool mirrors it."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The target copied blocks src -> dst (copy-on-write); a draft with its own pool does the same."""

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int) -> CaptureReport | None:
        """After allocate_kv_cache at start-up: capture the proposer's own CUDA graphs (a draft model on the torch
        backend on CUDA), bounded by the engine's limits; None when it has none."""
