"""LLMEngine: add_request / step / abort over one plan (docs/architecture.md §6).

One step = Scheduler.schedule -> InputBuilder.build -> Executor.execute -> Sampler -> Scheduler.update,
then a RequestOutput (with text/token deltas for streaming) for every request that advanced. The engine
is single-threaded; the async server drives it from one task.

With async scheduling (on by default on CUDA) one step stays in flight: step() schedules and launches step N+1
before it processes step N's sampled tokens, which meanwhile travel to the host behind step N. The order, and why
greedy output stays the same, is in docs/architecture.md ("The step loop").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from trtopt.builder.plan import PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError, RequestError, WorkerDiedError
from trtopt.runtime.batch import (
    CompletionOutput, EngineStats, RequestOutput, ScheduledBatch, StepInputs, StepOutput, fill_placeholders,
)
from trtopt.runtime.block_pool import BlockPool
from trtopt.runtime.detokenizer import IncrementalDetokenizer
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.input_builder import InputBuilder
from trtopt.runtime.input_processor import InputLimits, InputProcessor, PromptType, prompt_byte_cap
from trtopt.runtime.kv_cache_manager import KVCacheManager
from trtopt.runtime.request import Request, RequestStatus
from trtopt.runtime.sampler import PendingTokens, Sampler, prompt_logprobs
from trtopt.runtime.sampling_params import RequestOutputKind, SamplingParams
from trtopt.runtime.scheduler import Scheduler
from trtopt.runtime.spec_decode import SpecDecoder, SpeculativeConfig, create_spec_decoder
from trtopt.runtime.structured_output import GrammarCompiler, GrammarMatcher

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs. None = take the plan's limit. Frozen: derived values are returned, never written back."""

    num_blocks: int | None = None  # KV blocks per layer incl. the null block; None = from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # used when num_blocks is None
    max_num_batched_tokens: int | None = None  # token budget per step (<= plan max_num_tokens)
    max_num_seqs: int | None = None  # sequences per step (<= plan max_num_seqs)
    max_model_len: int | None = None  # prompt + output tokens (<= plan max_model_len)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int | None = None  # seeds draws of requests that have no seed of their own
    # Speculative decoding: a dict like {"method": "ngram", "num_speculative_tokens": 4} (vLLM's keys), its JSON
    # text, or a SpeculativeConfig; None = off. See runtime/spec_decode.
    speculative_config: Any = None
    # Async scheduling: schedule and launch step N+1 before step N's tokens reach the host (one step in flight).
    # None = on for a CUDA device, off on CPU (nothing runs meanwhile there). Speculative decoding steps stay
    # synchronous (the proposer needs the tokens).
    async_scheduling: bool | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedLimits:
    """EngineConfig merged with the plan's limits and checked."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_blocks_per_seq: int


def block_bytes(plan: PlanConfig, block_size: int | None = None) -> int:
    """Bytes one KV block takes across every layer of `plan` (K and V)."""
    m = plan.model
    return m.num_layers * 2 * m.num_kv_heads * (block_size or plan.limits.block_size) * m.head_dim * _DTYPE_BYTES.get(m.dtype, 4)


def resolve_limits(plan: PlanConfig, config: EngineConfig, draft_block_bytes: int = 0) -> ResolvedLimits:
    """draft_block_bytes: what one block of a speculative draft's own pools takes (0 without one). The draft's pools
    have the target's block count (the same block ids), so kv_cache_memory_gb holds both: num_blocks comes from
    the sum of the two per-block sizes, and the memory splits between them in that proportion."""
    lim = plan.limits

    def capped(name: str, value: int | None, plan_max: int) -> int:
        if value is None:
            return plan_max
        if not 1 <= value <= plan_max:
            raise ConfigError(f"{name}={value} must be in [1, {plan_max}] (the plan's limit); rebuild the plan to raise it.")
        return value

    max_model_len = capped("max_model_len", config.max_model_len, lim.max_model_len)
    max_num_seqs = capped("max_num_seqs", config.max_num_seqs, lim.max_num_seqs)
    max_tokens = capped("max_num_batched_tokens", config.max_num_batched_tokens, lim.max_num_tokens)
    max_blocks_per_seq = -(-max_model_len // lim.block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = block_bytes(plan) + draft_block_bytes
        # More blocks than every sequence at full length can use would only waste memory.
        num_blocks = min(int(config.kv_cache_memory_gb * 2**30) // per_block, max_num_seqs * max_blocks_per_seq) + 1
    if num_blocks - 1 < max_blocks_per_seq:
        raise ConfigError(
            f"{num_blocks - 1} usable KV blocks cannot hold one sequence of max_model_len={max_model_len} "
            f"({max_blocks_per_seq} blocks of {lim.block_size}); raise num_blocks/kv_cache_memory_gb or lower max_model_len."
        )
    return ResolvedLimits(num_blocks, lim.block_size, max_tokens, max_num_seqs, max_model_len, max_blocks_per_seq)


@dataclasses.dataclass
class _InFlight:
    """A launched step whose sampled tokens are not processed yet (async scheduling)."""

    batch: ScheduledBatch
    reqs: list[Request]  # the sequences that sample: row k of `tokens` is reqs[k]'s token
    tokens: PendingTokens


@dataclasses.dataclass
class _Group:
    """The n sequences of one request id, and what has been reported of them so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    num_reported: list[int]  # output tokens of each sequence already sent in a RequestOutput


class LLMEngine:
    def __init__(self, executor: Executor, plan: PlanConfig, tokenizer: Any = None, config: EngineConfig = EngineConfig(),
                 *, plan_dir: str | Path | None = None, backend: str = "torch", device: str = "cpu") -> None:
        """plan_dir/backend/device: where a speculative draft plan is found and how it runs (from_plan passes them)."""
        if plan.kind != "paged":
            raise ConfigError(f"the plan is of kind {plan.kind!r}; LLMEngine runs 'paged' LLM plans built by `trtopt build`.")
        self.plan = plan
        self.tokenizer = tokenizer
        spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.limits = resolve_limits(plan, config, _draft_block_bytes(spec_config, plan))
        executor.allocate_kv_cache(self.limits.num_blocks)
        if hasattr(executor, "capture_graphs"):  # at start-up, not inside the first steps
            # A verifying sequence asks for K+1 logits rows: graphs must hold that many per sequence, or every
            # verification step would run eagerly.
            rows = self.limits.max_num_seqs * (1 + (spec_config.num_speculative_tokens if spec_config else 0))
            executor.capture_graphs(max_num_seqs=self.limits.max_num_seqs,
                                    max_num_tokens=self.limits.max_num_batched_tokens,
                                    max_logits=min(rows, self.limits.max_num_batched_tokens))
        self.executor = executor
        self.input_builder = InputBuilder(self.limits.block_size, self.limits.max_blocks_per_seq)
        self.spec = self._create_spec_decoder(spec_config, plan_dir, backend, device)
        self.pool = BlockPool(self.limits.num_blocks, self.limits.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, copy_blocks=self._copy_blocks)
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_num_seqs=self.limits.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
        )
        self.sampler = Sampler(config.seed)
        self.input_processor = InputProcessor(tokenizer, InputLimits(
            vocab_size=plan.model.vocab_size, max_model_len=self.limits.max_model_len,
            max_num_seqs=self.limits.max_num_seqs,
            max_prompt_tokens_per_step=None if config.enable_chunked_prefill else self.limits.max_num_batched_tokens,
            max_prompt_bytes=prompt_byte_cap(tokenizer, self.limits.max_model_len),
        ))
        self._groups: dict[str, _Group] = {}
        self.num_consecutive_failed_steps = 0  # executor failures in a row; a driver stops a broken engine
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # compile_grammar runs on server worker threads too
        self._num_steps = 0
        self._num_batched_tokens = 0
        self._num_generated_tokens = 0
        self.async_scheduling = self._resolve_async(config.async_scheduling, device)
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step not yet processed

    def _resolve_async(self, wanted: bool | None, device: str) -> bool:
        if wanted is None:
            wanted = default_async_scheduling(device)
        if wanted and self.spec is not None:
            log.info("async scheduling is off with speculative decoding: its proposer needs each step's tokens")
            return False
        return bool(wanted)

    @classmethod
    def from_plan(cls, plan_dir: str | Path, *, backend: str = "torch", device: str = "cpu",
                  cuda_graphs: bool | None = None, tensor_parallel_size: int | None = None,
                  **config: Any) -> LLMEngine:
        """Load a plan dir (model.onnx, plan.json, tokenizer files) and start an engine on `backend`.

        cuda_graphs: replay captured CUDA graphs for decode-only steps; None (the default) turns them on wherever
        they apply (the torch backend on a CUDA device). False runs every step eagerly (vLLM's enforce_eager).
        tensor_parallel_size: ranks for a plan built with --tensor-parallel (None = the plan's own size); above 1
        the engine drives worker processes (trtopt/runtime/distributed.py). Call shutdown() when done.
        """
        from trtopt.runtime.distributed import open_executor  # the executors pull in heavy deps

        if cuda_graphs is None:
            cuda_graphs = default_cuda_graphs(backend, device)
        executor, plan = open_executor(plan_dir, backend=backend, device=device, cuda_graphs=cuda_graphs,
                                       tensor_parallel_size=tensor_parallel_size)
        return cls(executor, plan, load_tokenizer(plan_dir), EngineConfig(**config), plan_dir=plan_dir, backend=backend,
                   device=device)

    def _create_spec_decoder(self, spec_config: SpeculativeConfig | None, plan_dir: str | Path | None, backend: str,
                             device: str) -> SpecDecoder | None:
        if spec_config is None:
            return None
        spec = create_spec_decoder(
            spec_config, target=self.executor, plan=self.plan, plan_dir=plan_dir, backend=backend, device=device,
            input_builder=self.input_builder, max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_model_len=self.limits.max_model_len,
        )
        spec.proposer.allocate_kv_cache(self.limits.num_blocks)
        spec.capture_report = spec.proposer.capture_graphs(max_num_seqs=self.limits.max_num_seqs,
                                                           max_num_tokens=self.limits.max_num_batched_tokens)
        return spec

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write in the target's pools and in a speculative draft's own pools (same block ids)."""
        self.executor.copy_blocks(pairs)
        if self.spec is not None:
            self.spec.proposer.copy_blocks(pairs)

    def shutdown(self) -> None:
        """Release the executor's processes (tensor-parallel workers); a no-op for single-device executors."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *, arrival_time: float | None = None) -> None:
        """Queue a request. Raises RequestError (and changes nothing) if the prompt or params are invalid.

        `prompt` is any form InputProcessor takes. Front ends with a step thread pass a ProcessedPrompt, made by
        `self.input_processor.process` on their own thread, so no tokenizing happens here.
        """
        params = params or SamplingParams()
        processed = self.input_processor.process(prompt, params)
        self._check_request_id(request_id, params)
        token_ids = processed.prompt_token_ids
        grammar = self.compile_grammar(params)
        eos = tuple(self.plan.model.eos_token_ids)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if i == 0 else f"{request_id}#{i}"
            req = Request(
                seq_id, token_ids, params.for_completion(i), eos_token_ids=eos,
                max_model_len=self.limits.max_model_len, parent_id=request_id, index=i, arrival_time=arrival_time,
            )
            if self.tokenizer is not None:
                req.detok = IncrementalDetokenizer(self.tokenizer, token_ids, req.params)
            if grammar is not None:
                req.grammar = GrammarMatcher(grammar)  # each completion walks the grammar on its own
            req.bad_words_token_ids = processed.bad_words_token_ids
            seqs.append(req)
        self.scheduler.add_request(seqs[0], seqs[1:])
        self._groups[request_id] = _Group(processed.prompt, token_ids, seqs, [0] * params.n)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (xgrammar), or None without structured_outputs; RequestError for a bad
        spec. Thread-safe and cached per spec: a front end with a step thread calls it on its own thread first, so
        the call in add_request, on the step thread, is a cache hit."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured output needs the plan's tokenizer files (the grammar is matched against token texts).")
        with self._grammar_lock:
            if self._grammar_compiler is None:  # built on first use: reading the vocabulary takes about a second
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.plan.model.vocab_size,
                                                         self.plan.model.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request now and free its blocks. False if it is unknown or done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for req in group.seqs:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def _check_request_id(self, request_id: str, params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}.")
        # params.n <= max_num_seqs here (the input processor checked it), so this loop is short.
        if request_id in self._groups or any(f"{request_id}#{i}" in self.scheduler.requests for i in range(1, params.n)):
            raise RequestError(f"request id {request_id!r} is already in use; give each request a unique id.")
        if self.spec is not None and (params.logprobs is not None or params.structured_outputs is not None
                                      or params.prompt_logprobs is not None or params.has_token_controls):
            raise RequestError("logprobs, prompt_logprobs, structured outputs, logits_processors, allowed_token_ids, "
                               "bad_words and logit_bias are not available with speculative decoding on; drop them or "
                               "start the engine without speculative_config.")

    # ---- stepping ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got a token or finished.

        With async scheduling the tokens reported are those of the step launched by the previous call (the one
        launched now is reported by the next call), so the first call reports nothing but failures.

        Faults stay with their owner (docs/architecture.md, "Failure isolation"): a request whose inputs,
        sampling or update raises ends alone with finish_reason="error" (and `error` set), its blocks freed,
        while the step goes on for the others. When the executor fails, the whole step's requests end that
        way and the prefix cache is reset; `num_consecutive_failed_steps` counts such steps so a driver can
        tell a broken engine. Nothing is retried. An exception that escapes step() is an engine bug (a broken
        scheduler invariant) or WorkerDiedError (a tensor-parallel rank died; every request has been ended): the
        engine must not be stepped again.
        """
        if self.async_scheduling:
            return self._step_async()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        requests = self.scheduler.requests
        try:
            proposals = self.spec.propose(batch, requests, self.sampler) if self.spec is not None else {}
        except Exception as e:
            return self._fail_step(batch, e)
        inputs, batch, failed = self._build_inputs(batch)
        if batch.is_empty:
            return failed  # every sequence left belonged to a request that failed its inputs
        try:
            if isinstance(inputs, Exception):
                raise inputs
            logits = self.executor.execute(inputs)  # [N, vocab]; K+1 rows per speculating sequence
            if self.spec is not None:  # verification (and the plain sampler for the other rows)
                output, sample_errors = self.spec.sample(logits, batch, requests, proposals, self.sampler,
                                                         self._greedy_tokens(logits.shape[0]))
        except WorkerDiedError as e:
            self._worker_died(batch, e)
            raise  # the driver (LLM.generate, the serving loop) stops this engine instead of failing every later step
        except Exception as e:
            return failed + self._fail_step(batch, e)
        self.num_consecutive_failed_steps = 0
        if self.spec is None:
            ids = batch.sampling_ids
            reqs = [requests[i] for i in ids]
            sampled = self.sampler.sample_each(logits[: len(ids)], reqs, self._greedy_tokens(len(ids))) if ids else []
            output = StepOutput(sampled={rid: s for rid, s in zip(ids, sampled) if not isinstance(s, Exception)})
            sample_errors = {rid: s for rid, s in zip(ids, sampled) if isinstance(s, Exception)}
            if batch.num_prompt_logprob_rows:
                self._record_prompt_logprobs(batch, logits[len(ids):], requests)
        num_generated = len(output.sampled) + sum(len(t) for t in output.spec_tokens.values())
        changed, errors = self.scheduler.update(batch, output)
        errors.update(sample_errors)
        if errors:
            failed += self._fail_requests(errors, "sampling or updating")
        self._num_steps += 1
        # Computed and kept: the scheduled tokens plus the accepted drafts (one per generated token but the last).
        self._num_batched_tokens += sum(s.num_new_tokens for s in batch.seqs) + num_generated - len(output.sampled) - len(output.spec_tokens)
        self._num_generated_tokens += num_generated
        return failed + self._outputs(changed)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, logits: Any, requests: dict[str, Request]) -> None:
        """Append this step's prompt logprobs to their requests: logits holds the prompt_logprob_positions rows of
        the batch's sequences in order (InputBuilder put them after the sampling rows)."""
        seqs = [s for s in batch.seqs if s.prompt_logprob_positions]
        targets = [requests[s.request_id].token_ids[p + 1] for s in seqs for p in s.prompt_logprob_positions]
        ks = [requests[s.request_id].params.prompt_logprobs for s in seqs]
        rows = prompt_logprobs(logits, targets, max(ks))
        start = 0
        for seq, k in zip(seqs, ks):
            req = requests[seq.request_id]
            end = start + len(seq.prompt_logprob_positions)
            assert seq.prompt_logprob_positions.start == len(req.prompt_logprobs), "prompt logprobs are filled in order"
            req.prompt_logprobs += [_top(row, k) for row in rows[start:end]]
            start = end

    def _step_async(self) -> list[RequestOutput]:
        """Schedule, build and launch step N+1, then process step N's tokens while N+1 runs, then sample N+1.

        Step N's sequences were advanced when it was launched, each sampling one with a placeholder token: N+1 is
        scheduled as if each got its token, and its input ids read the placeholders' tokens on the device. A
        sequence that step N ends (stop, max_tokens) has its N+1 row discarded: it is not sampled, and its blocks
        (with the extra slot N+1 wrote) are already freed. Sampling N+1 comes after processing N, so penalties,
        min_tokens and grammars see every token before N+1's, as in the synchronous loop.
        """
        prev, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        failed: list[RequestOutput] = []
        logits, error = None, None
        if not batch.is_empty:
            inputs, batch, failed = self._build_inputs(batch)
            if not batch.is_empty:
                try:
                    if isinstance(inputs, Exception):
                        raise inputs
                    logits = self.executor.execute(self._with_sampled_ids(inputs, prev))
                except WorkerDiedError as e:
                    self._worker_died(batch, e)
                    raise
                except Exception as e:
                    error = e
        outs = failed + (self._process(prev) if prev is not None else [])
        # Outputs in the order things happened: step N's tokens before step N+1's failures.
        if error is not None:
            outs += self._fail_step(batch, error)
        elif logits is not None:
            self.num_consecutive_failed_steps = 0
            outs += self._sample_in_flight(batch, logits)
        return outs

    def _with_sampled_ids(self, inputs: StepInputs, prev: _InFlight | None) -> StepInputs:
        """Hand the previous step's sampled ids to the executor for the placeholders among the input ids: on the
        device where the executor reads them there, else filled in on the host (which waits for them)."""
        if prev is None:
            return inputs
        if getattr(self.executor, "resolves_placeholders", False):
            return dataclasses.replace(inputs, sampled_ids=prev.tokens.token_ids)
        host_ids = torch.tensor([s.token_id if not isinstance(s, Exception) else 0 for s in prev.tokens.resolve()],
                                dtype=torch.int64)
        return dataclasses.replace(inputs, input_ids=fill_placeholders(inputs.input_ids, host_ids))

    def _sample_in_flight(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the launched step's live rows (tokens stay on the device where possible), end the requests
        whose row failed, and advance the batch with placeholders. Returns the failed requests' outputs."""
        requests = self.scheduler.requests
        ids = batch.sampling_ids
        rows = [k for k, rid in enumerate(ids) if rid in requests]  # the others ended since scheduling
        reqs = [requests[ids[k]] for k in rows]
        failed: list[RequestOutput] = []
        tokens = None
        if reqs:
            if len(rows) == len(ids):
                live, argmax = logits[: len(ids)], self._greedy_tokens(len(ids))
            else:  # the graph's argmax rows are the step's, not these
                live, argmax = logits[torch.tensor(rows, device=logits.device)], None
            tokens = self.sampler.sample_async(live, reqs, argmax)
            if tokens.sampled is not None:  # sampled on the host: a row's own error ends its request now
                errors = {r.request_id: s for r, s in zip(reqs, tokens.sampled) if isinstance(s, Exception)}
                if errors:
                    failed = self._fail_requests(errors, "sampling")
        prompt_seqs = [s for s in batch.seqs if s.prompt_logprob_positions]
        if prompt_seqs and all(s.request_id in requests for s in prompt_seqs):  # rows after the sampling rows
            self._record_prompt_logprobs(batch, logits[len(ids):], requests)
        placeholders = {r.request_id: k for k, r in enumerate(reqs) if requests.get(r.request_id) is r}
        self._num_batched_tokens += self.scheduler.advance_scheduled(batch, placeholders)
        self._num_steps += 1
        if placeholders:
            self._in_flight = _InFlight(batch, reqs, tokens)
        return failed

    def _greedy_tokens(self, n: int) -> torch.Tensor | None:
        """The greedy argmax of the last executed step's first n logits rows, if its CUDA graph computed it
        (cuda_graphs.argmax_in_graph), else None (the sampler then takes it itself, if it needs it)."""
        tokens = getattr(self.executor, "last_greedy_tokens", None)
        return tokens[:n] if tokens is not None else None

    def _process(self, prev: _InFlight) -> list[RequestOutput]:
        """Step N's tokens on the host: placeholders resolved, stop conditions applied, outputs made."""
        try:
            sampled = prev.tokens.resolve()
        except Exception as e:  # a device fault surfaces at the first wait on it
            return self._fail_step(prev.batch, e)
        output = StepOutput(sampled={r.request_id: s for r, s in zip(prev.reqs, sampled) if not isinstance(s, Exception)})
        changed, errors = self.scheduler.update_sampled(prev.reqs, output)
        self._num_generated_tokens += sum(1 for r in changed)
        failed = self._fail_requests(errors, "updating") if errors else []
        return failed + self._outputs(changed)

    def _build_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs | Exception, ScheduledBatch, list[RequestOutput]]:
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
        failed = self._fail_requests(culprits, "preparing the inputs of")
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

    def _fail_requests(self, errors: dict[str, Exception], stage: str) -> list[RequestOutput]:
        """End the requests of these sequences (every completion of each) with finish_reason="error"."""
        messages: dict[str, str] = {}
        for seq_id, e in errors.items():
            log.warning("request sequence %s failed while %s its step; ending it with finish_reason='error'",
                        seq_id, stage, exc_info=e)
            parent = self._parent_of(seq_id)
            if parent is not None:
                messages.setdefault(parent, f"the engine failed while {stage} this request: {type(e).__name__}: {e}")
        return self._fail_groups(messages)

    def _parent_of(self, seq_id: str) -> str | None:
        # Only on the failure path: a linear search keeps the hot path free of a seq -> parent map.
        return next((parent for parent, g in self._groups.items() if any(r.request_id == seq_id for r in g.seqs)), None)

    def _worker_died(self, batch: ScheduledBatch, error: WorkerDiedError) -> None:
        """A tensor-parallel rank is gone for good: the step fails and every request ends now (the caller re-raises,
        so the engine is not stepped again)."""
        self._fail_step(batch, error)
        self._fail_groups(dict.fromkeys(self._groups, f"the engine stopped: {error}"))

    def _fail_step(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """The step failed as a whole (proposer, executor or the device's sampled tokens): count it in
        num_consecutive_failed_steps and end its batch's requests (_fail_batch)."""
        self.num_consecutive_failed_steps += 1
        return self._fail_batch(batch, error)

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """The executor raised: end the batch's requests as errors so nothing leaks, and forget cached
        prefixes whose blocks may now hold partial writes. Other requests go on."""
        log.error("executor failed on a step of %d sequences; finishing them with finish_reason='error'",
                  len(batch.seqs), exc_info=error)
        message = f"the model failed on a step of this request: {type(error).__name__}: {error}"
        parents = dict.fromkeys(p for s in batch.seqs if (p := self._parent_of(s.request_id)) is not None)
        outs = self._fail_groups(dict.fromkeys(parents, message))
        self.pool.reset_prefix_cache()
        return outs

    def _fail_groups(self, messages: dict[str, str]) -> list[RequestOutput]:
        """End every unfinished sequence of each request (parent id -> error message) and report it finished."""
        outs = []
        for parent, message in messages.items():
            group = self._groups.pop(parent)
            for req in group.seqs:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)  # [] if already ended
            out = self._group_output(parent, group)
            out.error = message
            outs.append(out)
        return outs

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        parents = list(dict.fromkeys(r.parent_id for r in changed))
        outs = []
        for parent in parents:
            group = self._groups.get(parent)
            if group is None:
                continue  # it failed this step; its error output is already made
            if group.seqs[0].params.output_kind is RequestOutputKind.FINAL_ONLY and not all(r.status.finished for r in group.seqs):
                continue  # RequestOutputKind.FINAL_ONLY: one output, when every completion has finished
            out = self._group_output(parent, group)
            if out.finished:
                del self._groups[parent]
            outs.append(out)
        return outs

    def _group_output(self, request_id: str, group: _Group) -> RequestOutput:
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

    # ---- introspection -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.requests) - len(s.running),
            num_blocks_total=self.pool.num_usable_blocks,
            num_blocks_free=self.pool.num_free_blocks,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_batched_tokens - self._num_generated_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_prefix_cache_hit_tokens=s.num_cached_tokens,
            num_draft_tokens=self.spec.stats.num_draft_tokens if self.spec else 0,
            num_accepted_tokens=self.spec.stats.num_accepted_tokens if self.spec else 0,
            num_accepted_per_position=tuple(self.spec.stats.accepted_per_position) if self.spec else (),
        )


def _draft_block_bytes(spec: SpeculativeConfig | None, plan: PlanConfig) -> int:
    """Per-block bytes of a draft plan's own pools (method draft_model); 0 for n-gram and self-draft (which runs on
    the target's pools), and for a draft plan that cannot be read (create_spec_decoder then says what is wrong)."""
    if spec is None or spec.method != "draft_model" or not (Path(spec.model) / "plan.json").is_file():
        return 0
    try:
        return block_bytes(read_plan(spec.model), plan.limits.block_size)
    except BuildError:
        return 0


def _top(row: tuple[int, float, list[tuple[int, float]]], k: int) -> dict[int, float]:
    """The prompt token's logprob plus the top-k alternatives (the token first, as in `Request.logprobs`)."""
    token, logprob, top = row
    return {token: logprob, **dict(top[:k])}

def default_async_scheduling(device: str) -> bool:
    """Async scheduling pays off where the host can work while the device runs: a CUDA device."""
    return str(device).startswith("cuda")


def default_cuda_graphs(backend: str, device: str) -> bool:
    """Decode steps replay CUDA graphs by default where they can: the torch backend on a CUDA device."""
    return backend == "torch" and str(device).startswith("cuda")


def load_tokenizer(plan_dir: str | Path) -> Any:
    """The plan's HF tokenizer, or None when the plan dir has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(plan_dir))
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s); only token-id prompts will work", plan_dir, e)
        return None
