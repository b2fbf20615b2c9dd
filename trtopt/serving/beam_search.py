"""BeamSearchStream: the server's beam search (vLLM's `use_beam_search`), run over the AsyncLLMEngine.

It drives runtime/beam_search.py's BeamSearch for each prompt of a request through the engine's one door: every
round, the live beams of all the request's prompts are prepared in one worker-thread call and added with one
add_requests (so they share engine steps with every other request), and their final outputs feed the searches.
When a prompt's search ends, the stream yields its one RequestOutput (every beam a completion, finished), so the
server renders it with the same code as any request: the stream is a RequestStream to it. close() aborts the round
in flight (as does cancelling the task that iterates), which frees its KV blocks; a failed round raises the
engine's error (RequestFailedError, EngineDeadError, RequestAbortedError) as a RequestStream would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.beam_search import BeamSearch, BeamSearchParams
from trtopt.runtime.request import RequestMetrics
from trtopt.serving.async_engine import AsyncLLMEngine, PreparedRequest, RequestStream


class BeamSearchStream:
    """The beam searches of one request's prompts, as an async iterator of their final RequestOutputs."""

    def __init__(self, engine: AsyncLLMEngine, prompts: list[tuple[str, PreparedRequest]], params: BeamSearchParams,
                 *, logprobs: int | None = None) -> None:
        """prompts: (request id, the prompt prepared with max_tokens resolved); logprobs: None, or k for each output
        token's logprob and top-k alternatives. Raises RequestError when the beam width needs more logprobs than the
        engine's max_logprobs."""
        self._engine = engine
        self._step = params.step_params(logprobs, max_logprobs=engine.max_logprobs)
        self._logprobs = logprobs
        self._searches = {rid: BeamSearch(p.prompt_token_ids, _resolved(params, p), eos_token_ids=engine.eos_token_ids)
                          for rid, p in prompts}
        self._texts = {rid: p.prompt.prompt for rid, p in prompts}
        self._metrics = {rid: RequestMetrics(arrival_time=time.monotonic()) for rid, _ in prompts}
        self._round: RequestStream | None = None  # the engine requests of the round in flight
        self._rounds = 0
        self._closed = False
        self._outputs = self._run()

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        return await self._outputs.__anext__()

    def close(self) -> None:
        """Abort the round in flight (its blocks are freed before the next step); nothing more is yielded."""
        self._closed = True
        if self._round is not None:
            self._round.close()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        open_ = dict(self._searches)
        while open_ and not self._closed:
            batch = [(rid, tokens) for rid, search in open_.items() for tokens in search.pending()]
            ids = [f"{rid}-beam{self._rounds}-{i}" for i, (rid, _) in enumerate(batch)]
            self._rounds += 1
            prepared = await asyncio.to_thread(self._engine.prepare_batch, [t for _, t in batch], self._step)
            finals = await self._run_round(list(zip(ids, prepared)))
            if finals is None:
                return
            rows: dict[str, list[dict[int, float]]] = {rid: [] for rid in open_}
            for round_id, (rid, _) in zip(ids, batch):
                out = finals[round_id]
                self._note_times(rid, out)
                assert out.outputs[0].logprobs, "a finished one-token request with logprobs has its token's row"
                rows[rid].append(out.outputs[0].logprobs[0])
            for rid, search in list(open_.items()):
                search.advance(rows[rid])
                if search.done:
                    del open_[rid]
                    self._metrics[rid].finished_time = time.monotonic()
                    yield search.request_output(rid, self._texts[rid], self._engine.tokenizer,
                                                logprobs=self._logprobs, metrics=self._metrics[rid])

    async def _run_round(self, requests: list[tuple[str, PreparedRequest]]) -> dict[str, RequestOutput] | None:
        """Add one engine request per live beam and wait for all of them (None: close() ended the round); leaves
        none of them in the engine."""
        self._round = await self._engine.add_requests(requests)
        finals = {}
        try:
            async for out in self._round:
                if out.finished:
                    finals[out.request_id] = out
        finally:  # a cancellation, a failed request or close(): abort what has not finished
            self._round.close()
            self._round = None
        return None if self._closed else finals

    def _note_times(self, rid: str, out: RequestOutput) -> None:
        """The search's metrics: its first round's queueing and first token, and its last round's token."""
        m, step = self._metrics[rid], out.metrics
        if m.first_token_time is None:
            m.first_scheduled_time, m.first_token_time = step.first_scheduled_time, step.first_token_time
            m.num_cached_tokens = step.num_cached_tokens
        m.last_token_time = step.last_token_time


def _resolved(params: BeamSearchParams, prompt: PreparedRequest) -> BeamSearchParams:
    """params with max_tokens the prompt's budget (prepare resolved None to what the context leaves)."""
    return dataclasses.replace(params, max_tokens=prompt.prompt.max_tokens)
