"""Request: the state of one sequence from arrival to finish.

A request holds token ids and counters only; its KV block ids belong to KVCacheManager, and the blocks
themselves to BlockPool (docs/architecture.md §6). An n>1 prompt becomes n Requests ("id", "id#1", ...): the first
one prefills the prompt and the others fork from its blocks (copy-on-write) when its prefill completes.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

import torch

from trtopt.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trtopt.runtime.detokenizer import IncrementalDetokenizer
    from trtopt.runtime.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue with no blocks; recomputes prompt + outputs
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the executor failed on a step this request was in

    def __init__(self, value: str) -> None:
        # Plain attributes, not properties: every step reads them for every running sequence.
        self.finished = value in ("stop", "length", "abort", "error")
        self.reason = value if self.finished else None  # the OpenAI finish_reason


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) and counters of one sequence."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # Speculative decoding: draft tokens proposed (and verified), accepted, and steps that verified drafts.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    def record_speculation(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_spec_steps += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any draft was verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens gained per verification step: accepted drafts + the one token drawn after them."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def decode_tokens_per_s(self, num_output_tokens: int) -> float | None:
        """Tokens/s after the first token (the decode rate this sequence saw)."""
        if self.first_token_time is None or self.last_token_time is None or num_output_tokens < 2:
            return None
        span = self.last_token_time - self.first_token_time
        return (num_output_tokens - 1) / span if span > 0 else None


class TokenCounts:
    """The output views of ``token_ids`` (prompt + output): what the sampler's processing reads, shared by a Request
    and its speculative DraftContexts. The subclass sets token_ids and num_prompt_tokens."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Request(TokenCounts):
    """One sequence. Mutated only by the Scheduler (and the Sampler, which advances `generator`)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int,
        parent_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        assert prompt_token_ids, "an empty prompt must be rejected before a Request is made"
        assert params.n == 1, "a Request is one sequence; split n>1 with SamplingParams.for_completion"
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # which completion of the parent request this is
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, appended in place
        # Never generate past max_model_len: the KV cache and position embeddings end there.
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (including prefix-cache hits)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.detok: IncrementalDetokenizer | None = None  # set by the engine when a tokenizer exists
        self.grammar: GrammarMatcher | None = None  # set by the engine for structured output; advanced by the Scheduler
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.pending_forks: list[Request] = []  # n>1 siblings that fork from this prompt's blocks
        self.logprobs: list[dict[int, float]] = []  # per output token: chosen + top-k alternatives
        # params.bad_words as token sequences (InputProcessor made them); the sampler bans their last tokens.
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
        # params.prompt_logprobs: entry j is prompt token j+1's logprob given tokens 0..j (+ the top-k), filled in
        # order by the steps that compute the prompt (the engine owns it; a recompute after preemption skips it).
        self.prompt_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def prompt_logprob_positions(self) -> range:
        """Prompt positions whose logits are still wanted for prompt_logprobs (position p predicts token p+1)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs), self.num_prompt_tokens - 1)

    @property
    def has_placeholder(self) -> bool:
        """The last token is a placeholder (async scheduling): sampled on the device, not yet known here."""
        return self.token_ids[-1] < 0

    @property
    def num_seats(self) -> int:
        """Running slots this request needs on admission: itself plus the siblings that will fork from it."""
        return 1 + len(self.pending_forks)

    @property
    def finish_reason(self) -> str | None:
        return self.status.reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
