"""Typed stage contracts of the runtime (docs/architecture.md §3, §6).

Scheduler -> ScheduledBatch -> InputBuilder -> StepInputs -> Executor -> logits -> Sampler -> StepOutput ->
Scheduler.update -> RequestOutput.

StepInputs is the packed paged signature of one engine step, exactly the graph inputs of a built plan
(minus the KV pools, which the executor owns).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trtopt.runtime.request import RequestMetrics


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
    # Async scheduling: the previous step's sampled ids, on the executor's device. An input id -1-k is a placeholder
    # for row k of it; executors that read it on the device say so (`resolves_placeholders`), the engine fills the
    # ids on the host for the others (fill_placeholders).
    sampled_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def fill_placeholders(input_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """input_ids with each placeholder -1-k replaced by sampled_ids[k] (both on one device; no host sync)."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, sampled_ids[rows], input_ids)


def fill_placeholders_(input_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """fill_placeholders in place on input_ids (returned): one Triton launch for contiguous int64 CUDA tensors
    (instead of the five kernels and a copy of the torch ops), the torch ops everywhere else."""
    if (input_ids.is_cuda and sampled_ids.device == input_ids.device and input_ids.dtype == sampled_ids.dtype
            == torch.int64 and input_ids.is_contiguous() and sampled_ids.is_contiguous()):
        from trtopt.runtime.kernels.placeholders_triton import fill_placeholders_triton

        return fill_placeholders_triton(input_ids, sampled_ids)
    return input_ids.copy_(fill_placeholders(input_ids, sampled_ids))


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step, as the scheduler decided it."""

    request_id: str
    token_ids: list[int]  # the num_new tokens to compute, at positions start_pos .. start_pos+num_new-1
    start_pos: int  # tokens already in the cache (== num_computed_tokens before this step)
    block_ids: list[int]  # the block table after allocation (covers start_pos + num_new tokens)
    samples: bool  # True when this chunk reaches the end of the sequence, so a token is sampled
    # Speculative decoding (runtime/spec_decode): slots reserved after token_ids for up to num_lookahead draft
    # tokens; the proposer fills spec_token_ids (<= num_lookahead) before the step runs. Each draft token is one
    # more query row and one more logits row; the KV of the rejected ones is rolled back in Scheduler.update.
    num_lookahead: int = 0
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # prompt_logprobs: the positions of this chunk whose logits are wanted too (position p predicts prompt token
    # p+1). Their logits rows come after every sampling row of the step, in batch order.
    prompt_logprob_positions: range = range(0)

    @property
    def num_new_tokens(self) -> int:
        """Committed tokens computed this step (draft tokens excluded: they are verified, not committed)."""
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Query rows this sequence puts into the step: its new tokens plus its draft tokens."""
        return len(self.token_ids) + len(self.spec_token_ids)


@dataclasses.dataclass
class ScheduledBatch:
    """Scheduler -> InputBuilder/engine: what runs in one step."""

    seqs: list[ScheduledSeq]  # running requests first, then newly admitted ones
    num_batched_tokens: int  # sum of num_new_tokens, <= max_num_batched_tokens
    preempted_ids: list[str]  # requests preempted while building this batch (freed; they recompute later)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def sampling_ids(self) -> list[str]:
        """Request ids that get a token this step, in logits-row order."""
        return [s.request_id for s in self.seqs if s.samples]

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Logits rows after the sampling rows, for prompt_logprobs."""
        return sum(len(s.prompt_logprob_positions) for s in self.seqs)


@dataclasses.dataclass
class SampledToken:
    """One token the sampler chose, with its logprobs (raw model log_softmax, before any penalty)."""

    token_id: int
    logprob: float | None = None  # None unless the request asked for logprobs
    top_logprobs: dict[int, float] | None = None  # chosen token + top-k alternatives -> logprob


@dataclasses.dataclass
class StepOutput:
    """Engine -> Scheduler.update: the tokens sampled this step."""

    sampled: dict[str, SampledToken]  # request id -> its new token (only sequences that sampled)
    # Speculating sequences: the accepted draft tokens followed by the one token drawn after them (bonus or
    # correction), in order; they take the place of `sampled` for those ids.
    spec_tokens: dict[str, list[SampledToken]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput, plus the deltas of this step for streaming)."""

    index: int  # which of the n completions
    text: str  # all text so far (cut before a stop string unless include_stop_str_in_output)
    token_ids: list[int]  # all generated token ids so far
    delta_text: str  # text new since the previous RequestOutput (UTF-8 safe, stop-string safe)
    delta_token_ids: list[int]  # token ids new since the previous RequestOutput
    logprobs: list[dict[int, float]] | None  # per token: chosen + top alternatives; None unless asked
    cumulative_logprob: float | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What the engine returns for a request after a step (and what LLM.generate returns at the end)."""

    request_id: str
    prompt: str | None  # the prompt text when one was given
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per completion, ordered by index
    finished: bool  # every completion finished
    metrics: "RequestMetrics"  # of completion 0: arrival, first token, finish times, cached prompt tokens
    error: str | None = None  # why the request failed, when it ended with finish_reason "error"
    # With params.prompt_logprobs (vLLM's shape): None for the first prompt token, then per prompt token its
    # logprob given the tokens before it plus the top-k alternatives (raw log_softmax); set once the prompt is in.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine load, for logs, metrics endpoints and tests."""

    num_running: int  # sequences holding KV blocks and scheduled every step
    num_waiting: int  # sequences queued for admission (new or preempted)
    num_blocks_total: int  # usable blocks (the null block excluded)
    num_blocks_free: int  # ref count 0 (may still hold a prefix-cached block)
    num_preemptions: int  # since the engine started
    num_steps: int
    # Prompt tokens of the requests whose prefill is done (first token out), whole prompts as vLLM's
    # prompt_tokens counts them: prefix-cache hits included, an n>1 request's prompt once.
    num_prompt_tokens: int
    num_computed_prompt_tokens: int  # prompt tokens the model computed (prefix-cache hits excluded; recomputation
    #                                  after a preemption included)
    num_generated_tokens: int
    num_prefix_cache_hit_tokens: int  # prompt tokens served from the prefix cache
    # Speculative decoding (zeros when it is off): draft tokens verified, those accepted, and accepted counts by
    # draft position (index j: the (j+1)-th draft token of a step was accepted).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_position: tuple[int, ...] = ()
    kv_cache_dtype: str = ""  # the KV pools' dtype (PlanConfig.kv_pool_dtype): e.g. "bfloat16", "float8_e4m3fn"

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free
