"""AsyncLLMEngine: asyncio front of an EngineLoop, for the HTTP server.

Each request gets a RequestStream (an async iterator over its RequestOutputs). The step thread hands outputs
to the stream's asyncio.Queue through loop.call_soon_threadsafe. Adds never block the event loop, even while
a step runs: they are queued for the step thread and awaited as futures. Requests are prepared (tokenized, checked,
their grammar compiled) off both the event loop and the step thread: by the caller with prepare() on a worker
thread, or here on one for a raw prompt (EngineLoop.prepare).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from trtopt.runtime.batch import EngineStats, RequestOutput
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.input_processor import PromptType
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.engine_loop import (
    DEFAULT_STOP_TIMEOUT_S, EngineDeadError, EngineLoop, PreparedRequest, RequestAbortedError, RequestFailedError,
)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "PreparedRequest", "RequestAbortedError", "RequestFailedError",
           "RequestStream"]


class RequestStream:
    """The outputs of one or more engine requests (a batched prompt), as one async iterator in arrival order.

    It ends when every request has finished, or at the first error. close() aborts whatever has not finished.
    """

    def __init__(self, request_ids: list[str], loop: EngineLoop) -> None:
        self.request_ids = request_ids
        self._open = set(request_ids)  # requests that have not finished (aborted on close)
        self._failed = False
        self._engine_loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()  # RequestOutput items, or an exception that ends the stream
        self._event_loop = asyncio.get_running_loop()

    @property
    def finished(self) -> bool:
        return not self._open or self._failed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._failed = True  # the failed request is gone from the engine; close() aborts its siblings
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort every request that has not finished (their KV blocks are freed before the next step)."""
        for rid in self._open:
            self._engine_loop.abort(rid)
        self._open.clear()

    def put(self, item: RequestOutput | BaseException) -> None:
        """The EngineLoop callback (runs on the step thread)."""
        # The event loop may be closed already (a client gone with its loop); nothing waits then.
        with contextlib.suppress(RuntimeError):
            self._event_loop.call_soon_threadsafe(self._queue.put_nowait, item)


class AsyncLLMEngine:
    """`stream = await engine.add_request(...)`, then `async for out in stream`, then `stream.close()`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.loop = EngineLoop(engine)  # owns the engine: everything here goes through it

    def start(self) -> None:
        """Start the step loop. Raises EngineDeadError once it was stopped: a stopped engine never restarts."""
        self.loop.start()

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Stop the loop within about `timeout` s: in-flight requests end with EngineDeadError (EngineLoop.stop)."""
        return self.loop.stop(timeout)

    @property
    def is_running(self) -> bool:
        return self.loop.is_running

    @property
    def dead_reason(self) -> str | None:
        """Why the engine broke (repeated step failures or an engine bug); None while healthy or after a clean stop."""
        return self.loop.dead_reason

    @property
    def tokenizer(self) -> Any:
        """The plan's HF tokenizer, or None for a plan without tokenizer files."""
        return self.loop.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loop.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.loop.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.loop.eos_token_ids

    @property
    def max_logprobs(self) -> int:
        return self.loop.max_logprobs

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """EngineLoop.tokenize, on the caller's thread (call it from a worker thread for a long prompt)."""
        return self.loop.tokenize(prompt)

    def prepare(self, prompt: PromptType, params: SamplingParams) -> PreparedRequest:
        """EngineLoop.prepare, on the caller's thread: call it from a worker thread, never the event loop (a long
        prompt or a grammar takes up to seconds). Raises RequestError."""
        return self.loop.prepare(prompt, params)

    def prepare_batch(self, prompts: list[PromptType], params: SamplingParams) -> list[PreparedRequest]:
        """EngineLoop.prepare_batch, on the caller's thread (as prepare)."""
        return self.loop.prepare_batch(prompts, params)

    def stats(self) -> EngineStats:
        return self.loop.stats()

    @property
    def is_sleeping(self) -> bool:
        return self.loop.is_sleeping

    @property
    def sleep_level(self) -> int | None:
        """The level the engine sleeps at; None while awake."""
        return self.loop.sleep_level

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """EngineLoop.sleep, awaited until the engine sleeps. Raises RequestError (changing nothing) for what this
        engine cannot do."""
        if not self.loop.started:
            self.loop.start()
        await asyncio.wrap_future(self.loop.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """EngineLoop.wake_up, awaited until applied. Raises RequestError for an unknown tag."""
        if not self.loop.started:
            self.loop.start()
        await asyncio.wrap_future(self.loop.wake_up(tags))

    async def add_request(self, request_id: str, prompt: PromptType | PreparedRequest,
                          params: SamplingParams | None = None) -> RequestStream:
        """Queue a request and return its stream. Raises RequestError (changing nothing) if it is invalid.

        `prompt` is a PreparedRequest (then no params: it carries its own) or any raw prompt form, prepared here
        on a worker thread with `params`. The caller must close() the stream in a finally block: leaving early (a
        client disconnect, a cancellation) then aborts the request and frees its KV blocks.
        """
        return await self.add_requests([(request_id, prompt)], params)

    async def add_requests(self, requests: list[tuple[str, PromptType | PreparedRequest]],
                           params: SamplingParams | None = None) -> RequestStream:
        """Queue several (request id, prompt) pairs, streamed together; raw prompts share `params` (see
        add_request). All or none: if one is invalid, nothing is queued (or the others are aborted) and its
        RequestError is raised."""
        prepared = [(rid, await self._prepared(prompt, params)) for rid, prompt in requests]
        if not self.loop.started:
            self.loop.start()  # the first request starts the loop; a stopped loop is never restarted
        stream = RequestStream([rid for rid, _ in prepared], self.loop)
        added = [self.loop.submit(rid, request, stream.put) for rid, request in prepared]
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in added), return_exceptions=True)
        except asyncio.CancelledError:
            # The caller went away before the adds landed; aborts are applied after adds, so no blocks leak.
            stream.close()
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            stream.close()  # aborting an id the engine refused is a no-op
            raise error
        return stream

    async def _prepared(self, prompt: PromptType | PreparedRequest, params: SamplingParams | None) -> PreparedRequest:
        if isinstance(prompt, PreparedRequest):
            assert params is None, "a PreparedRequest carries its own params"
            return prompt
        return await asyncio.to_thread(self.loop.prepare, prompt, params or SamplingParams())

    async def generate(self, request_id: str, prompt: PromptType | PreparedRequest,
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """add_request, then yield the outputs until the request finishes (aborting it if left early)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()
