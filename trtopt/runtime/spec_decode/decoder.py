"""SpecDecoder: the engine's one hook into speculative decoding (docs/architecture.md §6).

engine.step: schedule (K lookahead slots per decoding sequence) -> SpecDecoder.propose (fills spec_token_ids) ->
InputBuilder (K+1 query and logits rows per speculating sequence) -> target -> SpecDecoder.sample (rejection.py:
accepted drafts + one token per sequence; the plain sampler for the others) -> Scheduler.update (appends them
with the stop checks, rolls back the KV of rejected drafts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Mapping

import torch

from trtopt.builder.plan import PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import SampledToken, ScheduledBatch, StepOutput
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.cuda_graphs import CaptureReport
from trtopt.runtime.input_builder import InputBuilder
from trtopt.runtime.kernels.argmax import greedy_argmax
from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler
from trtopt.builder.draft import self_draft_dir
from trtopt.runtime.spec_decode.config import SpeculativeConfig
from trtopt.runtime.spec_decode.ngram import NgramProposer
from trtopt.runtime.spec_decode.proposer import Proposal, Proposer
from trtopt.runtime.spec_decode.rejection import greedy_verify, plain_greedy, target_probs_for, verify_one


@dataclasses.dataclass
class SpecStats:
    """Engine-wide counters (Prometheus reads them through EngineStats)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self.capture_report: CaptureReport | None = None  # the draft's CUDA graphs, captured at engine start-up

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def propose(self, batch: ScheduledBatch, requests: Mapping[str, Request], sampler: Sampler) -> dict[str, Proposal]:
        """Fill spec_token_ids of the batch's speculating sequences; return the proposals (kept for sample)."""
        proposals = self.proposer.propose(batch, requests, sampler)
        for seq in batch.seqs:
            prop = proposals.get(seq.request_id)
            if prop is not None:
                assert 1 <= len(prop.token_ids) <= seq.num_lookahead, f"{seq.request_id}: bad proposal length"
                seq.spec_token_ids = list(prop.token_ids)
        batch.num_batched_tokens = sum(s.num_query_tokens for s in batch.seqs)
        return proposals

    def sample(self, logits: torch.Tensor, batch: ScheduledBatch, requests: Mapping[str, Request],
               proposals: Mapping[str, Proposal], sampler: Sampler,
               greedy_tokens: torch.Tensor | None = None) -> tuple[StepOutput, dict[str, Exception]]:
        """Logits rows -> the StepOutput: verification for speculating sequences, the sampler for the others.

        greedy_tokens: the argmax of these logits rows when the step computed it already (inside its CUDA graph:
        the executor's `last_greedy_tokens`); then the verification launches no argmax of its own.

        A sequence whose sampling or verification raises is left out of the output and returned with its error
        (the engine ends that request; the others go on), as Sampler.sample_each does."""
        plain_rows, plain_reqs, spans = [], [], []
        row = 0
        for seq in batch.seqs:
            if not seq.samples:
                continue
            req = requests[seq.request_id]
            if seq.spec_token_ids:
                spans.append((req, seq.spec_token_ids, row))
                row += len(seq.spec_token_ids) + 1
            else:
                plain_rows.append(row)
                plain_reqs.append(req)
                row += 1
        # One argmax and one device->host read for every plain greedy row of the step (plain or verifying): the
        # common case is greedy throughout, and each further read would wait for the device again.
        greedy_plain = [plain_greedy(r) for r in plain_reqs]
        any_greedy = any(greedy_plain) or any(plain_greedy(r) for r, _, _ in spans)
        argmax = None
        if any_greedy:
            argmax = (greedy_argmax(logits[:row], kernel=sampler.argmax_kernel) if greedy_tokens is None
                      else greedy_tokens[:row]).tolist()
        output, errors = StepOutput(sampled={}), {}
        rest = [(r, req) for r, req, g in zip(plain_rows, plain_reqs, greedy_plain) if not g]
        for r, req, g in zip(plain_rows, plain_reqs, greedy_plain):
            if g:
                output.sampled[req.request_id] = SampledToken(token_id=argmax[r])
        if rest:
            sampled = sampler.sample_each(logits[torch.tensor([r for r, _ in rest])], [req for _, req in rest])
            for (_, req), t in zip(rest, sampled):
                if isinstance(t, Exception):
                    errors[req.request_id] = t
                else:
                    output.sampled[req.request_id] = t
        for req, drafts, start in spans:
            k = len(drafts)
            try:
                if plain_greedy(req):
                    tokens, accepted = greedy_verify(argmax[start : start + k + 1], drafts)
                else:
                    p = target_probs_for(logits[start : start + k + 1], req, drafts)
                    tokens, accepted = verify_one(p, drafts, proposals[req.request_id].probs,
                                                  sampler.generator_for(req))
            except Exception as e:  # this request's own parameters: it ends with an error, the others go on
                errors[req.request_id] = e
                continue
            output.spec_tokens[req.request_id] = [SampledToken(token_id=t) for t in tokens]
            self.stats.record(k, accepted)
        return output, errors


def create_spec_decoder(config: SpeculativeConfig, *, target: Executor, plan: PlanConfig, plan_dir: str | Path | None,
                        backend: str, device: str, input_builder: InputBuilder, max_num_batched_tokens: int,
                        max_model_len: int) -> SpecDecoder:
    """The proposer `config` names, checked against the target plan (ConfigError says what to change)."""
    if config.method == "ngram":
        return SpecDecoder(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.spec_decode.draft_model import DraftModelProposer, share_weights

    if config.method == "self_draft":
        if plan_dir is None:
            raise ConfigError("self_draft needs the plan dir (start the engine with LLMEngine.from_plan / LLM).")
        draft_dir = self_draft_dir(plan_dir, config.num_layers)
        if not (draft_dir / "plan.json").is_file():
            raise ConfigError(f"{draft_dir} does not exist; build it with `trtopt build MODEL -o {plan_dir} "
                              f"--draft-layers {config.num_layers}` (or `trtopt draft {plan_dir} "
                              f"--layers {config.num_layers}`).")
        if backend != "torch":
            raise ConfigError("self_draft shares the target's KV pools and weights, which only the torch backend "
                              "exposes; use backend='torch', or method 'draft_model' with the draft plan dir.")
    else:
        draft_dir = Path(config.model)
        if not (draft_dir / "plan.json").is_file():
            raise ConfigError(f"the draft plan {draft_dir} does not exist (no plan.json); build one with "
                              "`trtopt build` or point 'model' at an existing plan dir.")
    draft_plan = _check_draft_plan(draft_dir, plan, plan_dir, max_num_batched_tokens, max_model_len)
    # The draft's K sequential forwards replay CUDA graphs wherever the target's steps do (torch on CUDA), with the
    # placeholder fill and greedy argmax inside them or not as the target's.
    executor = create_executor(backend, draft_dir, draft_plan, device=device, cuda_graphs=target.graphs is not None,
                               argmax_in_graph=target.graphs is None or target.graphs.argmax_in_graph)
    if config.method == "self_draft":
        share_weights(executor.graph.module, target.graph.module)
        return SpecDecoder(config, DraftModelProposer(executor, input_builder, target=target))
    return SpecDecoder(config, DraftModelProposer(executor, input_builder))


def _check_draft_plan(draft_dir: Path, plan: PlanConfig, plan_dir: str | Path | None, max_tokens: int,
                      max_model_len: int) -> PlanConfig:
    try:
        draft = read_plan(draft_dir)
    except BuildError as e:
        raise ConfigError(f"the draft plan {draft_dir} cannot be read: {e}") from e
    if draft.model.vocab_size != plan.model.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({draft.model.vocab_size} tokens) differs from the target's "
                          f"({plan.model.vocab_size}); use a draft built from a model with the target's tokenizer.")
    if plan_dir is not None and _tokenizer_digest(draft_dir) != _tokenizer_digest(Path(plan_dir)):
        raise ConfigError(f"the draft plan {draft_dir} has a different tokenizer.json than the target; use a draft "
                          "built from a model with the target's tokenizer.")
    lim = draft.limits
    if lim.block_size != plan.limits.block_size:
        raise ConfigError(f"the draft plan has block_size {lim.block_size} but the target {plan.limits.block_size}; "
                          f"they share block tables: rebuild the draft with --block-size {plan.limits.block_size}.")
    if (lim.max_model_len < max_model_len or lim.max_num_tokens < max_tokens
            or lim.max_num_seqs < plan.limits.max_num_seqs):
        raise ConfigError(f"the draft plan's limits {lim} are below the target's (max_model_len {max_model_len}, "
                          f"max_num_tokens {max_tokens}, max_num_seqs {plan.limits.max_num_seqs}); rebuild the draft "
                          "with the target's --max-model-len/--max-num-tokens/--max-num-seqs.")
    if draft.model.dtype != plan.model.dtype:
        raise ConfigError(f"the draft plan is {draft.model.dtype} but the target {plan.model.dtype}; build both in "
                          "one dtype.")
    return draft


def _tokenizer_digest(plan_dir: Path) -> str | None:
    path = plan_dir / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
