"""Failure handling: a fault ends only the requests it belongs to (docs/architecture.md, "Failure isolation")."""

from __future__ import annotations

import logging

from trtopt.runtime.batch import RequestOutput, ScheduledBatch, StepInputs
from trtopt.runtime.block_pool import BlockPool
from trtopt.runtime.input_builder import InputBuilder
from trtopt.runtime.outputs import OutputProcessor
from trtopt.runtime.request import RequestStatus
from trtopt.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)


class FailureHandler:
    """Ends failed requests with finish_reason="error" (every completion of each, blocks freed) and reports them;
    the other requests go on. Holds the engine's parts it acts on, and no state of its own."""

    def __init__(self, scheduler: Scheduler, pool: BlockPool, outputs: OutputProcessor,
                 input_builder: InputBuilder) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.outputs = outputs
        self.input_builder = input_builder

    def build_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs | Exception, ScheduledBatch, list[RequestOutput]]:
        """The step's inputs, the batch they are for, and the outputs of requests ended on the way. If building
        raises, each sequence is built alone to find the ones at fault: those requests end with an error and the
        rest of the batch runs. Returns the exception instead of inputs when no single sequence is at fault (the
        step then fails as a whole); never raises, so the outputs of requests already ended are never lost."""
        try:
            return self.input_builder.build(batch), batch, []
        except Exception as e:
            error = e
        culprits: dict[str, Exception] = {}
        for seq in batch.seqs:
            try:
                self.input_builder.build(ScheduledBatch([seq], seq.num_new_tokens, []))
            except Exception as e:
                culprits[seq.request_id] = e
        if not culprits or len(culprits) == len(batch.seqs):
            return error, batch, []
        # Blocks the culprits were to write this step. Blocks enter the prefix cache when scheduled, so a request
        # admitted in this same step may have taken some of them as its cached prefix: they will never be written
        # now, and it must compute that prefix itself (it goes back to the queue, as after a preemption).
        bs = self.pool.block_size
        unwritten = {s.block_ids[p // bs] for s in batch.seqs if s.request_id in culprits
                     for p in range(s.start_pos, s.start_pos + s.num_new_tokens)}
        failed = self.fail_requests(culprits, "preparing the inputs of")
        # The culprits' blocks were registered in the prefix cache when scheduled, but their K/V will never be written.
        self.pool.reset_prefix_cache()
        seqs = [s for s in batch.seqs if s.request_id in self.scheduler.requests]
        stale = [s.request_id for s in seqs if any(b in unwritten for b in s.block_ids[: s.start_pos // bs])]
        if stale:
            self.scheduler.recompute(stale)
            seqs = [s for s in seqs if s.request_id not in stale]
        rest = ScheduledBatch(seqs, sum(s.num_new_tokens for s in seqs), [*batch.preempted_ids, *stale])
        if rest.is_empty:
            return error, rest, failed  # not run: step() returns the failed outputs only
        try:
            return self.input_builder.build(rest), rest, failed
        except Exception as e:
            return e, rest, failed

    def fail_requests(self, errors: dict[str, Exception], stage: str) -> list[RequestOutput]:
        """End the requests of these sequences (every completion of each) with finish_reason="error"."""
        messages: dict[str, str] = {}
        for seq_id, e in errors.items():
            log.warning("request sequence %s failed while %s its step; ending it with finish_reason='error'",
                        seq_id, stage, exc_info=e)
            parent = self.outputs.parent_of(seq_id)
            if parent is not None:
                messages.setdefault(parent, f"the engine failed while {stage} this request: {type(e).__name__}: {e}")
        return self.fail_groups(messages)

    def fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """The step failed as a whole: end the batch's requests as errors so nothing leaks, and forget cached
        prefixes whose blocks may now hold partial writes. Other requests go on."""
        log.error("executor failed on a step of %d sequences; finishing them with finish_reason='error'",
                  len(batch.seqs), exc_info=error)
        message = f"the model failed on a step of this request: {type(error).__name__}: {error}"
        parents = dict.fromkeys(p for s in batch.seqs if (p := self.outputs.parent_of(s.request_id)) is not None)
        outs = self.fail_groups(dict.fromkeys(parents, message))
        self.pool.reset_prefix_cache()
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every open request (the engine stops: a tensor-parallel rank died)."""
        return self.fail_groups(dict.fromkeys(self.outputs.groups, message))

    def fail_groups(self, messages: dict[str, str]) -> list[RequestOutput]:
        """End every unfinished sequence of each request (parent id -> error message) and report it finished."""
        outs = []
        for parent, message in messages.items():
            group = self.outputs.pop(parent)
            assert group is not None, f"request {parent!r} failed twice"
            for req in group.seqs:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)  # [] if already ended
            out = self.outputs.group_output(parent, group)
            out.error = message
            outs.append(out)
        return outs
