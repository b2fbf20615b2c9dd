"""Draft-model proposer: a smaller plan of the same vocabulary runs K steps ahead of the target.

Two ways to hold the draft's K/V, both on the target's block tables (the same block ids, so the block manager's
allocate / free / copy-on-write / prefix-cache decisions hold for both at once):

- own pool (method "draft_model"): the draft executor has its own pools with the target's number of blocks.
  It runs every token the target computes (prefill chunks included) in its first forward of the step, so a block
  the target has computed (or prefix-cached) also holds the draft's K/V for those tokens. The only lag is the
  last accepted draft token of a fully accepted run, which the draft computes at its next step.
- shared pools (method "self_draft"): the draft is the target's first N layers (trtopt build --draft-layers N)
  and runs on the target's own first N pools, which already hold the K/V of every computed token; it shares the
  target's weight tensors too.

Per step: forward 1 computes, per speculating sequence, the tokens it lacks up to the last committed one and
draws d_1 from its logits; forwards 2..K feed d_{j-1} and draw d_j. Every write lands in slots the scheduler
reserved for this step's verification rows (copied-on-write, never hashed), which the target then overwrites
with the same tokens or rolls back.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch

from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.cuda_graphs import CaptureReport
from trtopt.runtime.input_builder import InputBuilder
from trtopt.runtime.kernels.argmax import greedy_argmax
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler, processed_probs
from trtopt.runtime.spec_decode.proposer import Proposal
from trtopt.runtime.spec_decode.rejection import DraftContext, draw, plain_greedy

log = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, executor: Executor, input_builder: InputBuilder, *, target: Executor | None = None) -> None:
        """target: the target's executor when the draft runs on its first N pools (self-draft); None = own pool."""
        self.executor = executor
        self.input_builder = input_builder
        self.target = target
        self.shared_kv = target is not None
        # Own pool only: request id -> tokens whose K/V the draft pool holds (a prefix of the sequence).
        self._computed: dict[str, int] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.shared_kv:  # the target's first N pools, the very tensors (the target allocated them)
            self.executor.kv_caches = self.target.kv_caches[: self.executor.plan.model.num_layers]
            self.executor.num_blocks = num_blocks
            if self.executor.graphs is not None:
                self.executor.graphs.reset()  # its graphs captured the old pools' addresses
        else:
            self.executor.allocate_kv_cache(num_blocks)
        self._computed.clear()

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int) -> CaptureReport | None:
        """Capture the draft's step graphs now (torch on CUDA; None elsewhere), at its own buckets: its K-1 later
        forwards are decode steps of at most max_num_seqs rows, and its first forward, in the steady state, one or
        two tokens per sequence (own pool: the last token of a fully accepted run lags), so buckets stop at
        2 * max_num_seqs tokens. That bounds capture time and memory by about one target decode capture; a longer
        first forward (prefill chunks mirrored into an own pool) runs eagerly."""
        report = self.executor.capture_graphs(max_num_seqs=max_num_seqs,
                                              max_num_tokens=min(max_num_tokens, 2 * max_num_seqs))
        if report is not None:
            log.info("speculative draft: captured %d CUDA graphs in %.1f s, %.0f MiB", report.num_graphs,
                     report.seconds, report.pool_bytes / 2**20)
        return report

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not self.shared_kv:  # shared pools are copied by the target itself
            self.executor.copy_blocks(pairs)

    def propose(self, batch: ScheduledBatch, requests: Mapping[str, Request], sampler: Sampler) -> dict[str, Proposal]:
        first, spec = self._first_forward(batch, requests)
        if not first:
            return {}
        self._forget_finished(requests)
        logits = self.executor.execute(self.input_builder.build(ScheduledBatch(first, 0, [])))
        drafts: dict[str, list[int]] = {s.request_id: [] for s in spec}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in spec}
        # Plain greedy requests are verified by argmax alone (decoder.py), so their q is never read: their draft
        # token is the draft's argmax, one device->host read per forward for the whole batch.
        greedy = {s.request_id: plain_greedy(requests[s.request_id]) for s in spec}
        active = list(spec)
        for j in range(max((s.num_lookahead for s in spec), default=0)):
            if j:
                steps = [self._draft_step(s, drafts[s.request_id][-1], j) for s in active]
                logits = self.executor.execute(self.input_builder.build(ScheduledBatch(steps, 0, [])))
            logits = logits[: len(active)]
            # The draft graph's own argmax of these rows where it took one (its rows are `active`, in order).
            tokens = self.executor.last_greedy_tokens
            argmax = (greedy_argmax(logits, kernel=sampler.argmax_kernel) if tokens is None
                      else tokens[: len(active)]).tolist()
            sampled = [row for row, s in enumerate(active) if not greedy[s.request_id]]
            if sampled:
                reqs = [requests[active[row].request_id] for row in sampled]
                q = processed_probs(logits[sampled], [DraftContext(r, drafts[r.request_id]) for r in reqs])
                for i, (row, req) in enumerate(zip(sampled, reqs)):
                    argmax[row] = draw(q[i], float(torch.rand(1, generator=sampler.generator_for(req))))
                    probs[req.request_id].append(q[i])
            for s, token in zip(active, argmax):
                drafts[s.request_id].append(token)
            active = [s for s in active if s.num_lookahead > j + 1]
        for s in spec:  # it wrote the last committed token and d_1 .. d_{K-1}
            self._computed[s.request_id] = s.start_pos + s.num_lookahead
        return {rid: Proposal(toks, None if greedy[rid] else torch.stack(probs[rid])) for rid, toks in drafts.items()}

    def _first_forward(self, batch: ScheduledBatch,
                       requests: Mapping[str, Request]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """The rows of the draft's first forward, and the speculating sequences (who get a logits row there)."""
        rows, spec = [], []
        for seq in batch.seqs:
            req = requests[seq.request_id]
            # What the draft pool already holds: all the target computed (shared pools), else what the draft ran,
            # capped by the target's computed tokens (a preempted request restarts lower; prefix hits are held).
            start = (seq.start_pos if self.shared_kv
                     else min(self._computed.get(seq.request_id, seq.start_pos), seq.start_pos))
            end = seq.start_pos + seq.num_new_tokens
            if seq.num_lookahead:
                spec.append(seq)
            elif self.shared_kv:
                continue  # the target computes these rows' K/V itself
            rows.append(ScheduledSeq(seq.request_id, req.token_ids[start:end], start, seq.block_ids,
                                     samples=bool(seq.num_lookahead)))
            if not seq.num_lookahead:
                self._computed[seq.request_id] = end
        return rows, spec

    @staticmethod
    def _draft_step(seq: ScheduledSeq, token: int, j: int) -> ScheduledSeq:
        """Forward j+1 of a speculating sequence: d_j at position start_pos + j."""
        return ScheduledSeq(seq.request_id, [token], seq.start_pos + j, seq.block_ids, samples=True)

    def _forget_finished(self, requests: Mapping[str, Request]) -> None:
        if len(self._computed) > 2 * len(requests):
            self._computed = {rid: n for rid, n in self._computed.items() if rid in requests}


def share_weights(draft_module: torch.nn.Module, target_module: torch.nn.Module) -> int:
    """Point the draft's constant tensors at the target's equal ones (self-draft: they are the same weights), so
    the draft holds no copy. Returns the number of elements now shared."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for t in target_module.buffers():
        by_shape.setdefault((t.shape, t.dtype, t.device), []).append(t)
    shared = 0
    for name, t in list(draft_module.named_buffers()):
        if t.numel() < 1024:
            continue  # small constants are not worth the comparison
        match = next((c for c in by_shape.get((t.shape, t.dtype, t.device), ()) if torch.equal(c, t)), None)
        if match is not None:
            draft_module.register_buffer(name, match)
            shared += t.numel()
    return shared
