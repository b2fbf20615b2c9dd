"""LLMEngine: add_request / step / abort over one plan (docs/architecture.md §6).

One step = Scheduler.schedule -> InputBuilder.build -> Executor.execute -> Sampler -> Scheduler.update,
then a RequestOutput (with text/token deltas for streaming) for every request that advanced. The engine
is single-threaded: LLM calls it directly, and in the server the EngineLoop thread (serving/engine_loop.py) drives it.

With async scheduling (on by default on CUDA) one step stays in flight: step() schedules and launches step N+1
before it processes step N's sampled tokens, which meanwhile travel to the host behind step N. The order, and why
greedy output stays the same, is in docs/architecture.md ("The step loop").

Around the loop: runtime/config.py resolves the limits, runtime/outputs.py owns the n>1 groups and builds the
outputs, runtime/failures.py ends the requests a fault belongs to.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import torch

from trtopt.builder.plan import PlanConfig
from trtopt.errors import ConfigError, RequestError, WorkerDiedError
from trtopt.runtime.batch import EngineStats, RequestOutput, ScheduledBatch, StepInputs, StepOutput, fill_placeholders
from trtopt.runtime.block_pool import BlockPool
from trtopt.runtime.config import (
    EngineConfig, NodeConfig, default_cuda_graphs, draft_plan_block_bytes, load_tokenizer, resolve_async_scheduling,
    resolve_limits, resolve_max_logprobs,
)
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.failures import FailureHandler
from trtopt.runtime.input_builder import InputBuilder
from trtopt.runtime.input_processor import InputLimits, InputProcessor, PromptType, prompt_byte_cap
from trtopt.runtime.kv_cache_manager import KVCacheManager
from trtopt.runtime.outputs import OutputProcessor, fan_out, record_prompt_logprobs, seq_id
from trtopt.runtime.request import Request, RequestStatus
from trtopt.runtime.sampler import PendingTokens, Sampler
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.runtime.scheduler import Scheduler
from trtopt.runtime.spec_decode import SpecDecoder, SpeculativeConfig, create_spec_decoder
from trtopt.runtime.structured_output import GrammarCompiler


@dataclasses.dataclass
class _InFlight:
    """A launched step whose sampled tokens are not processed yet (async scheduling)."""

    batch: ScheduledBatch
    reqs: list[Request]  # the sequences that sample: row k of `tokens` is reqs[k]'s token
    tokens: PendingTokens


class LLMEngine:
    def __init__(self, executor: Executor, plan: PlanConfig, tokenizer: Any = None,
                 config: EngineConfig = EngineConfig(), *, plan_dir: str | Path | None = None, backend: str = "torch",
                 device: str = "cpu") -> None:
        """plan_dir/backend/device: where a speculative draft plan is found and how it runs (from_plan passes them)."""
        if plan.kind != "paged":
            raise ConfigError(
                f"the plan is of kind {plan.kind!r}; LLMEngine runs 'paged' LLM plans built by `trtopt build`.")
        self.plan = plan
        self.tokenizer = tokenizer
        spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.limits = resolve_limits(plan, config, draft_plan_block_bytes(spec_config, plan))
        executor.allocate_kv_cache(self.limits.num_blocks)
        # At start-up, not inside the first steps. A verifying sequence asks for K+1 logits rows: graphs must hold
        # that many per sequence, or every verification step would run eagerly.
        rows = self.limits.max_num_seqs * (1 + (spec_config.num_speculative_tokens if spec_config else 0))
        # Kept for restore_kv_cache, which captures the same graphs again over the new pools.
        self._graph_limits = {"max_num_seqs": self.limits.max_num_seqs,
                              "max_num_tokens": self.limits.max_num_batched_tokens,
                              "max_logits": min(rows, self.limits.max_num_batched_tokens)}
        executor.capture_graphs(**self._graph_limits)
        self.executor = executor
        self.kv_cache_released = False  # release_kv_cache() freed the pools; no step runs until restore_kv_cache()
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
            max_logprobs=resolve_max_logprobs(config.max_logprobs, plan.model.vocab_size),
        ))
        self.output_processor = OutputProcessor()  # the open requests' n sequences each
        self.failures = FailureHandler(self.scheduler, self.pool, self.output_processor, self.input_builder)
        self.num_consecutive_failed_steps = 0  # executor failures in a row; a driver stops a broken engine
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # compile_grammar runs on server worker threads too
        self._num_steps = 0
        self._num_batched_tokens = 0
        self._num_generated_tokens = 0
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, device,
                                                         speculative=self.spec is not None)
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step not yet processed

    @classmethod
    def from_plan(cls, plan_dir: str | Path, *, backend: str = "torch", device: str = "cpu",
                  cuda_graphs: bool | None = None, argmax_in_graph: bool = True,
                  tensor_parallel_size: int | None = None, nodes: NodeConfig | None = None,
                  **config: Any) -> LLMEngine:
        """Load a plan dir (model.onnx, plan.json, tokenizer files) and start an engine on `backend`.

        cuda_graphs: replay captured CUDA graphs for decode-only steps; None (the default) turns them on wherever
        they apply (the torch backend on a CUDA device). False runs every step eagerly (vLLM's enforce_eager).
        argmax_in_graph: with those graphs, each also fills the placeholders and takes the greedy argmax (the
        default); False launches both from Python between replays (create_executor; a speculative draft follows).
        tensor_parallel_size: ranks for a plan built with --tensor-parallel (None = the plan's own size); above 1
        the engine drives worker processes (runtime/executors/tensor_parallel.py). Call shutdown() when done.
        nodes: those ranks spread over several hosts, this one node 0 (NodeConfig; None = one host).
        """
        from trtopt.runtime.executors import create_executor  # the executors pull in heavy deps

        if cuda_graphs is None:
            cuda_graphs = default_cuda_graphs(backend, device)
        executor = create_executor(backend, plan_dir, device=device, cuda_graphs=cuda_graphs,
                                   tensor_parallel_size=tensor_parallel_size, argmax_in_graph=argmax_in_graph,
                                   nodes=nodes)
        return cls(executor, executor.plan, load_tokenizer(plan_dir), EngineConfig(**config), plan_dir=plan_dir,
                   backend=backend, device=device)

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
        self.executor.shutdown()

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, grammar: Any = None) -> None:
        """Queue a request. Raises RequestError (and changes nothing) if the prompt or params are invalid.

        `prompt` is any form InputProcessor takes. Front ends with a step thread prepare requests on their own
        thread (serving/engine_loop.py, EngineLoop.prepare): they pass a ProcessedPrompt, so no tokenizing happens
        here, and `grammar`, the compile_grammar(params) they already made, so no grammar compiles here either.
        """
        params = params or SamplingParams()
        processed = self.input_processor.process(prompt, params)
        self._check_request_id(request_id, params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        seqs = fan_out(request_id, processed, params, eos_token_ids=tuple(self.plan.model.eos_token_ids),
                       max_model_len=self.limits.max_model_len, arrival_time=arrival_time, tokenizer=self.tokenizer,
                       grammar=grammar)
        self.scheduler.add_request(seqs[0], seqs[1:])
        self.output_processor.add(request_id, processed.prompt, processed.prompt_token_ids, seqs)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) exactly as add_request would see them (chat messages rendered with the
        plan's template, one BOS rule); RequestError if the prompt is unusable. Public since the first release."""
        return self.input_processor.tokenize(prompt)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (xgrammar), or None without structured_outputs; RequestError for a bad
        spec. Thread-safe (xgrammar's compiler locks its own cache): front ends call it on their own thread and hand
        the result to add_request."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError(
                "structured output needs the plan's tokenizer files (the grammar is matched against token texts).")
        with self._grammar_lock:
            if self._grammar_compiler is None:  # built on first use: reading the vocabulary takes about a second
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.plan.model.vocab_size,
                                                         self.plan.model.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request now and free its blocks. False if it is unknown or done."""
        group = self.output_processor.pop(request_id)
        if group is None:
            return False
        for req in group.seqs:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    # ---- sleep (the server's POST /sleep?level=1; serving/engine_loop.py) --------------------------------

    def release_kv_cache(self) -> None:
        """Free the device memory of the KV pools (the pool keeps only the null block) between steps, with no
        request in the engine; the prefix cache is forgotten (its blocks' contents are gone). No step may run until
        restore_kv_cache(). RequestError with speculative decoding (its draft's pools are not released)."""
        if self.spec is not None:
            raise RequestError("releasing the KV cache (sleep level 1) is not supported with speculative decoding; "
                               "use sleep level 0 or serve without speculative_config.")
        assert not self.has_unfinished_requests(), "release_kv_cache() with requests in the engine"
        if self._in_flight is not None:  # async scheduling: the aborted requests' last launched step
            self.step()
        assert self._in_flight is None and self.pool.num_free_blocks == self.pool.num_usable_blocks, \
            "a block is held with no request in the engine"
        self.pool.reset_prefix_cache()
        self.executor.allocate_kv_cache(2)  # the fewest the executors take: the null block and one more
        self.kv_cache_released = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the pools' (and dropped graphs') memory back to the device

    def restore_kv_cache(self) -> None:
        """Reallocate the pools release_kv_cache() freed (zero-filled) and capture the step graphs again."""
        assert self.kv_cache_released, "restore_kv_cache() without release_kv_cache()"
        self.executor.allocate_kv_cache(self.limits.num_blocks)
        self.executor.capture_graphs(**self._graph_limits)
        self.kv_cache_released = False

    def _check_request_id(self, request_id: str, params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}.")
        # params.n <= max_num_seqs here (the input processor checked it), so this loop is short.
        if (request_id in self.output_processor.groups
                or any(seq_id(request_id, i) in self.scheduler.requests for i in range(1, params.n))):
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
        inputs, batch, failed = self.failures.build_inputs(batch)
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
                record_prompt_logprobs(batch, logits[len(ids):], requests)
        num_generated = len(output.sampled) + sum(len(t) for t in output.spec_tokens.values())
        changed, errors = self.scheduler.update(batch, output)
        errors.update(sample_errors)
        if errors:
            failed += self.failures.fail_requests(errors, "sampling or updating")
        self._num_steps += 1
        # Computed and kept: the scheduled tokens plus the accepted drafts (one per generated token but the last).
        self._num_batched_tokens += (sum(s.num_new_tokens for s in batch.seqs) + num_generated - len(output.sampled)
                                     - len(output.spec_tokens))
        self._num_generated_tokens += num_generated
        return failed + self.output_processor.outputs(changed)

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
            inputs, batch, failed = self.failures.build_inputs(batch)
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
        if self.executor.resolves_placeholders:
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
                    failed = self.failures.fail_requests(errors, "sampling")
        prompt_seqs = [s for s in batch.seqs if s.prompt_logprob_positions]
        if prompt_seqs and all(s.request_id in requests for s in prompt_seqs):  # rows after the sampling rows
            record_prompt_logprobs(batch, logits[len(ids):], requests)
        placeholders = {r.request_id: k for k, r in enumerate(reqs) if requests.get(r.request_id) is r}
        self._num_batched_tokens += self.scheduler.advance_scheduled(batch, placeholders)
        self._num_steps += 1
        if placeholders:
            self._in_flight = _InFlight(batch, reqs, tokens)
        return failed

    def _greedy_tokens(self, n: int) -> torch.Tensor | None:
        """The greedy argmax of the last executed step's first n logits rows, if its CUDA graph computed it
        (StepGraphs.argmax_in_graph), else None (the sampler then takes it itself, if it needs it)."""
        tokens = self.executor.last_greedy_tokens
        return tokens[:n] if tokens is not None else None

    def _process(self, prev: _InFlight) -> list[RequestOutput]:
        """Step N's tokens on the host: placeholders resolved, stop conditions applied, outputs made."""
        try:
            sampled = prev.tokens.resolve()
        except Exception as e:  # a device fault surfaces at the first wait on it
            return self._fail_step(prev.batch, e)
        output = StepOutput(
            sampled={r.request_id: s for r, s in zip(prev.reqs, sampled) if not isinstance(s, Exception)})
        changed, errors = self.scheduler.update_sampled(prev.reqs, output)
        self._num_generated_tokens += sum(1 for r in changed)
        failed = self.failures.fail_requests(errors, "updating") if errors else []
        return failed + self.output_processor.outputs(changed)

    def _fail_step(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """The step failed as a whole (proposer, executor or the device's sampled tokens): count it in
        num_consecutive_failed_steps and end its batch's requests."""
        self.num_consecutive_failed_steps += 1
        return self.failures.fail_batch(batch, error)

    def _worker_died(self, batch: ScheduledBatch, error: WorkerDiedError) -> None:
        """A tensor-parallel rank is gone for good: the step fails and every request ends now (the caller re-raises,
        so the engine is not stepped again)."""
        self._fail_step(batch, error)
        self.failures.fail_all(f"the engine stopped: {error}")

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
            num_prompt_tokens=s.num_prompt_tokens,
            num_computed_prompt_tokens=self._num_batched_tokens - self._num_generated_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_prefix_cache_hit_tokens=s.num_cached_tokens,
            num_draft_tokens=self.spec.stats.num_draft_tokens if self.spec else 0,
            num_accepted_tokens=self.spec.stats.num_accepted_tokens if self.spec else 0,
            num_accepted_per_position=tuple(self.spec.stats.accepted_per_position) if self.spec else (),
            kv_cache_dtype=self.plan.kv_pool_dtype,
        )
