"""Scheduler: one token-budget rule for every step (docs/architecture.md §6; vLLM v1's scheduler is the model).

Each step the running requests come first, oldest first: one token each when decoding, or the next chunk
of their prefill. Then waiting requests are admitted, first come first served, while the token budget,
the sequence limit and the free blocks allow; a prompt larger than the budget left is chunked. There are
no prefill or decode phases. When the pool runs out of blocks, the newest running request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed (prefix caching makes
that cheap). `update` appends the sampled tokens and applies the stop conditions.

Async scheduling (the engine's option; docs/architecture.md, "The step loop") splits `update` in two:
`advance_scheduled` runs as soon as a step is launched, counting its tokens as computed and appending a
placeholder (a negative id, -1-k = row k of the step's sampled ids, still on the device) for each sequence that
samples, so the next step can be scheduled before the tokens are known; `update_sampled` later puts the real
tokens in the placeholders' place and applies the stop conditions. A sequence holds at most one placeholder, and
only between those two calls.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

from trtopt.runtime.batch import SampledToken, ScheduledBatch, ScheduledSeq, StepOutput
from trtopt.runtime.kv_cache_manager import KVCacheManager
from trtopt.runtime.request import Request, RequestStatus


_NO_POSITIONS = range(0)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
    ) -> None:
        assert max_num_batched_tokens >= 1 and max_num_seqs >= 1 and num_speculative_tokens >= 0
        self.kv = kv
        self.num_speculative_tokens = num_speculative_tokens  # K: draft rows reserved per decoding sequence
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest (preempted first)
        self.requests: dict[str, Request] = {}  # every unfinished sequence, including n>1 siblings not yet forked
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, over all admissions
        self.num_prompt_tokens = 0  # whole prompts of the requests that produced a first token (n>1: once)

    # ---- queue management ------------------------------------------------------------------------------

    def add_request(self, request: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue a sequence; n>1 `siblings` fork from its blocks once its prompt is computed."""
        for r in (request, *siblings):
            assert r.request_id not in self.requests, f"duplicate request id {r.request_id!r}"
            self.requests[r.request_id] = r
        request.pending_forks = list(siblings)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request_id: str, status: RequestStatus) -> list[Request]:
        """End a sequence from outside (abort, error) wherever it is; its blocks are freed at once.

        A leader that ends before its prompt is computed takes its unforked n>1 siblings with it (they have
        nothing to fork from). Returns every sequence it ended ([] for an unknown or finished id).
        """
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # an n>1 sibling still waiting for its leader's prompt
            leader = self.requests.get(req.parent_id)
            assert leader is not None and req in leader.pending_forks, f"{request_id} is in no queue"
            leader.pending_forks.remove(req)
        orphans, req.pending_forks = req.pending_forks, []
        for r in (req, *orphans):
            self._finish(r, status)
        return [req, *orphans]

    # ---- schedule ----------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.max_num_batched_tokens, seqs, preempted)
        # After a preemption the pool is tight: admitting someone now would only be preempted next.
        if not preempted:
            budget = self._schedule_waiting(budget, seqs)
        return ScheduledBatch(seqs=seqs, num_batched_tokens=self.max_num_batched_tokens - budget, preempted_ids=preempted)

    def _schedule_running(self, budget: int, seqs: list[ScheduledSeq], preempted: list[str]) -> int:
        # The host side of every step, once per running sequence: kept to plain attribute reads and one allocation
        # call (at 256 running sequences each µs here is 0.25 ms of a step; benchmarks/bench_host_step.py).
        running, speculative = self.running, self.num_speculative_tokens
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.token_ids)
            if num_tokens - req.num_prompt_tokens >= req.max_tokens:
                i += 1  # async: its placeholder is its last token (max_tokens); it finishes when that is known
                continue
            num_new = min(num_tokens - req.num_computed_tokens, budget)
            assert num_new >= 1, f"{req} is running with nothing to compute"
            lookahead = self._num_lookahead(req, num_new, budget) if speculative else 0
            if not self._allocate_or_preempt(req, num_new, preempted, lookahead):
                break  # req preempted itself: everything after it is already gone too
            seqs.append(self._scheduled_seq(req, num_new, lookahead))
            budget -= num_new + lookahead
            i += 1
        return budget

    def _num_lookahead(self, req: Request, num_new: int, budget: int) -> int:
        """Draft rows for a decoding sequence: K, less where the budget or max_tokens leave less room."""
        if not self.num_speculative_tokens or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return 0  # prefilling (or recomputing after a preemption): nothing to verify yet
        room = req.max_tokens - req.num_output_tokens - 1  # the step adds accepted drafts + one token
        return max(0, min(self.num_speculative_tokens, budget - num_new, room))

    def _allocate_or_preempt(self, req: Request, num_new: int, preempted: list[str], lookahead: int = 0) -> bool:
        """Allocate req's slots, preempting the newest running requests until it fits. False if req itself went."""
        while self.kv.allocate_slots(req.request_id, req.token_ids, req.num_computed_tokens, num_new,
                                     num_lookahead_tokens=lookahead) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # first in line again: preemption must not cost it its turn

    def recompute(self, request_ids: Sequence[str]) -> None:
        """Send running sequences, scheduled in a step that has not run, back to the front of the queue to be
        computed again from their first token, as a preemption does (the engine's use: their cached prefix is a
        block that a failed request was to write in that step, so it will never hold their K/V)."""
        for request_id in reversed(request_ids):  # appendleft: the first id ends up first in line
            req = self.requests[request_id]
            assert req.status is RequestStatus.RUNNING and not req.has_placeholder, f"{req} cannot be recomputed"
            self.running.remove(req)
            self._preempt(req)

    def _schedule_waiting(self, budget: int, seqs: list[ScheduledSeq]) -> int:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) + req.num_seats > self.max_num_seqs:
                break
            num_new = self._admit(req, budget)
            if num_new is None:
                break  # first come, first served: nobody jumps the head of the queue
            seqs.append(self._scheduled_seq(req, num_new))
            budget -= num_new
        return budget

    def _admit(self, req: Request, budget: int) -> int | None:
        """Move the head of the queue to running with its first chunk allocated; None if it does not fit."""
        # A preempted sequence's placeholder is resolved before the next schedule (no admission follows a preemption).
        assert not req.has_placeholder, f"{req.request_id} is waiting with an unresolved placeholder"
        # A request that wants prompt_logprobs computes its whole prompt (vLLM's rule): a cached prefix has no logits.
        cached_blocks, num_cached = ([], 0) if req.params.prompt_logprobs is not None else self.kv.get_computed_blocks(req.token_ids)
        num_new = req.num_tokens - num_cached
        if not self.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(req.request_id, req.token_ids, num_cached, num_new, cached_blocks) is None:
            return None
        self.waiting.popleft()
        self.running.append(req)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
            req.metrics.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        self.num_cached_tokens += num_cached
        return num_new

    def _scheduled_seq(self, req: Request, num_new: int, lookahead: int = 0) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + num_new
        if req.params.prompt_logprobs is None:
            positions = _NO_POSITIONS
        else:
            wanted = req.prompt_logprob_positions
            positions = range(max(start, wanted.start), min(end, wanted.stop))
        return ScheduledSeq(req.request_id, req.token_ids[start:end], start, self.kv.block_ids(req.request_id),
                            end == len(req.token_ids), lookahead, prompt_logprob_positions=positions)

    # ---- update ------------------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, output: StepOutput) -> tuple[list[Request], dict[str, Exception]]:
        """Advance every scheduled sequence. Returns those that got a token or finished, in batch order, and
        the sequences whose update raised (say their detokenizer), with the error: the caller ends those
        requests; the others are advanced as usual. A sequence missing from `output.sampled` is skipped (the
        engine ended it: its token could not be sampled)."""
        changed: list[Request] = []
        failed: dict[str, Exception] = {}
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished from outside after scheduling
            if seq.samples and req.request_id not in output.sampled and req.request_id not in output.spec_tokens:
                continue
            try:
                if self._advance(req, seq, output):
                    changed.append(req)
            except Exception as e:  # this sequence's own fault: the others go on
                failed[req.request_id] = e
        return changed, failed

    def advance_scheduled(self, batch: ScheduledBatch, placeholder_rows: dict[str, int]) -> int:
        """Async scheduling, right after the step is launched: count each live sequence's scheduled tokens as
        computed and append the placeholder -1-k for those in `placeholder_rows` (request id -> row k of the
        step's sampled ids). Sequences that ended since scheduling are skipped. Returns the tokens counted."""
        num_tokens = 0
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished (stop, abort, error) after it was scheduled: its rows are discarded
            assert not seq.num_lookahead, "async scheduling runs without speculative decoding"
            req.num_computed_tokens += seq.num_new_tokens
            num_tokens += seq.num_new_tokens
            if seq.samples:
                assert not req.has_placeholder and seq.request_id in placeholder_rows, f"{req} samples without a row"
                req.token_ids.append(-1 - placeholder_rows[seq.request_id])
        return num_tokens

    def update_sampled(self, reqs: Sequence[Request], output: StepOutput) -> tuple[list[Request], dict[str, Exception]]:
        """Async scheduling: replace the placeholders of `reqs` (the sequences that sampled in an earlier
        advance_scheduled step) by their tokens and apply the stop conditions, as `update` does. A sequence that
        ended meanwhile is skipped; one preempted meanwhile gets its token in the waiting queue (and ends there if
        it stops). Returns the sequences that changed, in order, and those whose update raised."""
        changed: list[Request] = []
        failed: dict[str, Exception] = {}
        for req in reqs:
            if self.requests.get(req.request_id) is not req or req.request_id not in output.sampled:
                continue  # ended since (abort, error, a failed sampling row): its token is dropped
            assert req.has_placeholder, f"{req} has no placeholder to resolve"
            req.token_ids.pop()
            try:
                status = self._append_run(req, [output.sampled[req.request_id]])
                if req.status is RequestStatus.RUNNING:
                    self._fork_siblings(req)
                else:
                    self._queue_siblings(req)
                if status is not None:
                    self._dequeue(req)
                    self._finish(req, status)
                changed.append(req)
            except Exception as e:  # this sequence's own fault: the others go on
                failed[req.request_id] = e
        return changed, failed

    def _queue_siblings(self, leader: Request) -> None:
        """The leader sampled its first token but was preempted before that was known: its blocks are gone, so
        its n>1 siblings queue right behind it and compute the prompt themselves (prefix caching shares it)."""
        at = self.waiting.index(leader) + 1
        for sib in reversed(leader.pending_forks):
            self.waiting.insert(at, sib)
        leader.pending_forks = []

    def _dequeue(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _advance(self, req: Request, seq: ScheduledSeq, output: StepOutput) -> bool:
        """Apply one scheduled chunk to req; True if it got a token (and maybe finished)."""
        req.num_computed_tokens += seq.num_new_tokens
        if not seq.samples:
            return False  # a prefill chunk that does not reach the end of the prompt
        tokens = output.spec_tokens.get(req.request_id) or [output.sampled[req.request_id]]
        status = self._append_run(req, tokens)
        self._fork_siblings(req)
        if seq.spec_token_ids:
            req.metrics.record_speculation(len(seq.spec_token_ids), len(tokens) - 1)
        if status is not None:
            self.running.remove(req)
            self._finish(req, status)
        elif seq.num_lookahead:
            # Rollback: the accepted drafts' K/V stays; blocks holding only rejected drafts go back.
            self.kv.truncate(req.request_id, req.num_computed_tokens)
        return True

    def _append_run(self, req: Request, tokens: list[SampledToken]) -> RequestStatus | None:
        """Append tokens one by one, each checked against the stop conditions; what follows a stop is dropped.

        With speculation every token but the last is an accepted draft token, whose K/V this step computed.
        """
        if len(tokens) == 1:  # no speculation: the common case, without the loop
            self._append_token(req, tokens[0])
            return self._check_stop(req)
        for i, token in enumerate(tokens):
            if i:
                req.num_computed_tokens += 1  # the previous token was a draft: it is in the cache now
            self._append_token(req, token)
            status = self._check_stop(req)
            if status is not None:
                return status
        return None

    def _append_token(self, req: Request, token: SampledToken) -> None:
        now = time.monotonic()
        req.token_ids.append(token.token_id)
        if req.grammar is not None:
            # The sampler masked every token the grammar forbids, so a refusal is a bug, not user input.
            accepted = req.grammar.accept(token.token_id)
            assert accepted, f"{req.request_id}: the grammar refused sampled token {token.token_id}"
        if req.params.logprobs is not None:
            req.logprobs.append(token.top_logprobs or {})
            req.cumulative_logprob += token.logprob or 0.0
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            if req.index == 0:
                self.num_prompt_tokens += req.num_prompt_tokens
        req.metrics.last_token_time = now

    def _fork_siblings(self, leader: Request) -> None:
        """The leader's prompt is computed: its n>1 siblings share those blocks from now on."""
        for sib in leader.pending_forks:
            self.kv.fork(leader.request_id, sib.request_id)
            # The sibling recomputes only the last prompt token, to get logits of its own to sample from;
            # writing its K/V copies the shared last block first (copy-on-write).
            sib.num_computed_tokens = leader.num_prompt_tokens - 1
            sib.status = RequestStatus.RUNNING
            sib.metrics.first_scheduled_time = time.monotonic()
            self.running.append(sib)
        leader.pending_forks = []

    def _check_stop(self, req: Request) -> RequestStatus | None:
        token = req.token_ids[-1]
        # The sampler masks EOS and stop ids before min_tokens; stop strings are ignored there as well.
        past_min = req.num_output_tokens > req.params.min_tokens
        stop_token = past_min and (token in req.eos_token_ids or token in req.params.stop_token_ids)
        stop_str = req.detok.update(req.output_token_ids, stop_token=stop_token) if req.detok is not None else None
        if stop_token:
            if token not in req.eos_token_ids:
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if past_min:
            if stop_str is not None:
                req.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete (reached only through EOS, caught above, unless ignore_eos)
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        assert status.finished, f"{status} is not a finished status"
        if req.has_placeholder:
            req.token_ids.pop()  # ended before its in-flight token was known (abort, error): that token is dropped
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req.detok is not None:
            req.detok.finish()
