"""Output assembly: a request fanned out into its n sequences, tracked as one group, reported as RequestOutputs."""

from __future__ import annotations

import dataclasses
from typing import Any

from trtopt.runtime.batch import CompletionOutput, RequestOutput, ScheduledBatch
from trtopt.runtime.detokenizer import IncrementalDetokenizer
from trtopt.runtime.input_processor import ProcessedPrompt
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import prompt_logprobs
from trtopt.runtime.sampling_params import RequestOutputKind, SamplingParams, num_logprobs
from trtopt.runtime.structured_output import GrammarMatcher


def seq_id(request_id: str, index: int) -> str:
    """The id of completion `index` of a request: the leader (index 0) keeps the request's own id."""
    return request_id if index == 0 else f"{request_id}#{index}"


def fan_out(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *, eos_token_ids: tuple[int, ...],
            max_model_len: int, arrival_time: float | None, tokenizer: Any, grammar: Any) -> list[Request]:
    """The request's params.n sequences, each with its own detokenizer and grammar matcher (grammar: compiled, or
    None without structured outputs)."""
    token_ids = prompt.prompt_token_ids
    seqs = []
    for i in range(params.n):
        req = Request(
            seq_id(request_id, i), token_ids, params.for_completion(i), eos_token_ids=eos_token_ids,
            max_model_len=max_model_len, parent_id=request_id, index=i, arrival_time=arrival_time,
        )
        if tokenizer is not None:
            req.detok = IncrementalDetokenizer(tokenizer, token_ids, req.params)
        if grammar is not None:
            req.grammar = GrammarMatcher(grammar)  # each completion walks the grammar on its own
        req.bad_words_token_ids = prompt.bad_words_token_ids
        seqs.append(req)
    return seqs


@dataclasses.dataclass
class RequestGroup:
    """The n sequences of one request id, and what has been reported of them so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]  # seqs[i] is completion i; seqs[0] (the leader) has the request's own id
    num_reported: list[int]  # output tokens of each sequence already sent in a RequestOutput


class OutputProcessor:
    """Owns the open requests' groups (n>1 fan-out) and builds their RequestOutputs with streaming deltas."""

    def __init__(self) -> None:
        self.groups: dict[str, RequestGroup] = {}  # request id -> its sequences, until its final output

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Request]) -> None:
        assert request_id not in self.groups, f"request id {request_id!r} is open"
        self.groups[request_id] = RequestGroup(prompt, prompt_token_ids, seqs, [0] * len(seqs))

    def pop(self, request_id: str) -> RequestGroup | None:
        """Forget the request (it is aborted or failed); None if it is unknown or done."""
        return self.groups.pop(request_id, None)

    def parent_of(self, seq_id: str) -> str | None:
        """The request id a sequence belongs to, None once that request is done."""
        # Only on the failure path: a linear search keeps the hot path free of a seq -> parent map.
        return next((parent for parent, g in self.groups.items() if any(r.request_id == seq_id for r in g.seqs)), None)

    def outputs(self, changed: list[Request]) -> list[RequestOutput]:
        """One output per request among `changed` sequences; a finished request's group is forgotten."""
        parents = list(dict.fromkeys(r.parent_id for r in changed))
        outs = []
        for parent in parents:
            group = self.groups.get(parent)
            if group is None:
                continue  # it failed this step; its error output is already made
            if (group.seqs[0].params.output_kind is RequestOutputKind.FINAL_ONLY
                    and not all(r.status.finished for r in group.seqs)):
                continue  # RequestOutputKind.FINAL_ONLY: one output, when every completion has finished
            out = self.group_output(parent, group)
            if out.finished:
                del self.groups[parent]
            outs.append(out)
        return outs

    def group_output(self, request_id: str, group: RequestGroup) -> RequestOutput:
        """The group's RequestOutput; its deltas are what is new since the last one (marked reported now)."""
        completions = []
        for i, req in enumerate(group.seqs):
            out_ids = req.output_token_ids
            delta_ids = out_ids[group.num_reported[i] :]
            group.num_reported[i] = len(out_ids)
            want_lp = req.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=req.index,
                    text=req.detok.text if req.detok else "",
                    token_ids=out_ids,
                    delta_text=req.detok.take_delta() if req.detok else "",
                    delta_token_ids=delta_ids,
                    logprobs=list(req.logprobs) if want_lp else None,
                    cumulative_logprob=req.cumulative_logprob if want_lp else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        leader = group.seqs[0]
        prompt_lps = None
        if leader.params.prompt_logprobs is not None and len(leader.prompt_logprobs) == leader.num_prompt_tokens - 1:
            prompt_lps = [None, *leader.prompt_logprobs]
        return RequestOutput(
            request_id=request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=all(c.finished for c in completions),
            metrics=leader.metrics,
            prompt_logprobs=prompt_lps,
        )


def record_prompt_logprobs(batch: ScheduledBatch, logits: Any, requests: dict[str, Request]) -> None:
    """Append this step's prompt logprobs to their requests: logits holds the prompt_logprob_positions rows of
    the batch's sequences in order (InputBuilder put them after the sampling rows)."""
    seqs = [s for s in batch.seqs if s.prompt_logprob_positions]
    targets = [requests[s.request_id].token_ids[p + 1] for s in seqs for p in s.prompt_logprob_positions]
    ks = [num_logprobs(requests[s.request_id].params.prompt_logprobs, logits.shape[-1]) for s in seqs]
    rows = prompt_logprobs(logits, targets, max(ks))
    start = 0
    for seq, k in zip(seqs, ks):
        req = requests[seq.request_id]
        end = start + len(seq.prompt_logprob_positions)
        assert seq.prompt_logprob_positions.start == len(req.prompt_logprobs), "prompt logprobs are filled in order"
        req.prompt_logprobs += [_top(row, k) for row in rows[start:end]]
        start = end


def _top(row: tuple[int, float, list[tuple[int, float]]], k: int) -> dict[int, float]:
    """The prompt token's logprob plus the top-k alternatives (the token first, as in `Request.logprobs`)."""
    token, logprob, top = row
    return {token: logprob, **dict(top[:k])}
