"""N-gram / prompt-lookup proposer: the continuation of the most recent earlier occurrence of the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min), searched in the prompt and output so far.

The search is one numpy comparison over the history per sequence and n (sliding windows), never a Python loop
over tokens. It needs no model, so it costs nothing when it guesses wrong but the verification rows.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trtopt.runtime.batch import ScheduledBatch
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler
from trtopt.runtime.spec_decode.proposer import Proposal


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix (max_n .. min_n) of `tokens`."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: every occurrence that ends before the suffix itself does.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch: ScheduledBatch, requests: Mapping[str, Request], sampler: Sampler) -> dict[str, Proposal]:
        out = {}
        for seq in batch.seqs:
            if seq.num_lookahead:
                tokens = np.asarray(requests[seq.request_id].token_ids, dtype=np.int64)
                draft = ngram_lookup(tokens, seq.num_lookahead, self.min_n, self.max_n)
                if draft:
                    out[seq.request_id] = Proposal(draft)
        return out

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass  # no model, no KV

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass
