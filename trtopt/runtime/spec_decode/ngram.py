"""N-gram / prompt-lookup proposer: the continuation of the most recent earlier occurrence of the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min), searched in the prompt and output so far.

Vectorised over the batch: the step's histories are right-aligned in one [B, L] array (left padding -1, which no
token equals); the occurrences of every suffix length n come from n column comparisons over the whole batch, with
no Python loop over tokens, and the loop over sequences only copies rows. Each request's history is kept as a growing
numpy buffer that takes only the tokens appended since the last step, so a step does not convert whole token lists.
The proposer needs no model: a wrong guess costs only its verification rows.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from trtopt.runtime.batch import ScheduledBatch
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler
from trtopt.runtime.spec_decode.proposer import Proposal

_PAD = -1  # left padding of the right-aligned histories; token ids are >= 0


def ngram_lookup_batch(histories: np.ndarray, lengths: np.ndarray, ks: Sequence[int], min_n: int,
                       max_n: int) -> list[list[int]]:
    """For each row b of `histories` [B, L] (int64; its lengths[b] tokens right-aligned, padding _PAD before them):
    up to ks[b] tokens following the latest earlier occurrence of its longest suffix of max_n .. min_n tokens that
    occurs earlier (an occurrence ends before the suffix itself does). [] where none occurs."""
    num_rows, width = histories.shape
    max_n = min(max_n, width - 1)
    body = histories[:, : width - 1]  # an earlier occurrence ends at a column j <= width - 2
    # ends[n][b, j]: the n tokens ending at column j equal row b's last n tokens; built from n-1 with one more
    # column comparison, so the whole search is about 2 * max_n vector ops. Padding never equals a token.
    ends = {1: body == histories[:, width - 1 :]}
    for n in range(2, max_n + 1):
        m = np.zeros_like(ends[1])
        m[:, n - 1 :] = ends[n - 1][:, n - 1 :] & (body[:, : width - n] == histories[:, width - n : width - n + 1])
        ends[n] = m
    start = np.full(num_rows, -1, dtype=np.int64)  # column after the chosen occurrence; -1 = none
    for n in range(max_n, min_n - 1, -1):
        hits = ends[n]
        found = (start < 0) & (lengths > n) & hits.any(axis=1)  # a suffix of n tokens needs n + 1 tokens at least
        if found.any():
            latest = hits.shape[1] - 1 - hits[:, ::-1].argmax(axis=1)
            start = np.where(found, latest + 1, start)
    k_max = max(ks, default=0)
    cols = start[:, None] + np.arange(k_max)  # the continuation's columns (within the history: < width)
    tokens = histories[np.arange(num_rows)[:, None], np.clip(cols, 0, width - 1)]
    counts = np.where(start >= 0, np.minimum(np.asarray(ks, dtype=np.int64), width - start), 0)
    return [tokens[b, : counts[b]].tolist() for b in range(num_rows)]


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix (max_n .. min_n) of `tokens`."""
    return ngram_lookup_batch(tokens[None, :], np.array([tokens.shape[0]]), [k], min_n, max_n)[0]


@dataclasses.dataclass
class _History:
    """A request's token ids as a numpy buffer, grown by the tokens appended since it was last read."""

    request: Request  # the owner (an id may be reused by a later request: then the history starts over)
    buffer: np.ndarray
    length: int = 0

    def read(self) -> np.ndarray:
        ids = self.request.token_ids
        if len(ids) > self.buffer.shape[0]:
            grown = np.empty(max(len(ids), 2 * self.buffer.shape[0]), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if len(ids) > self.length:  # token ids only grow (rejected drafts are never appended)
            self.buffer[self.length : len(ids)] = ids[self.length :]
            self.length = len(ids)
        return self.buffer[: self.length]


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._histories: dict[str, _History] = {}

    def propose(self, batch: ScheduledBatch, requests: Mapping[str, Request], sampler: Sampler) -> dict[str, Proposal]:
        seqs = [s for s in batch.seqs if s.num_lookahead]
        if not seqs:
            return {}
        rows = [self._history(requests[s.request_id]) for s in seqs]
        width = max(r.shape[0] for r in rows)
        histories = np.full((len(rows), width), _PAD, dtype=np.int64)
        for b, r in enumerate(rows):
            histories[b, width - r.shape[0] :] = r
        lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
        drafts = ngram_lookup_batch(histories, lengths, [s.num_lookahead for s in seqs], self.min_n, self.max_n)
        self._forget_finished(requests)
        return {s.request_id: Proposal(d) for s, d in zip(seqs, drafts) if d}

    def _history(self, req: Request) -> np.ndarray:
        h = self._histories.get(req.request_id)
        if h is None or h.request is not req:
            h = self._histories[req.request_id] = _History(req, np.empty(max(64, 2 * req.num_tokens), dtype=np.int64))
        return h.read()

    def _forget_finished(self, requests: Mapping[str, Request]) -> None:
        if len(self._histories) > 2 * len(requests):
            self._histories = {rid: h for rid, h in self._histories.items() if requests.get(rid) is h.request}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass  # no model, no KV

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int) -> None:
        return None  # nothing runs on the device
