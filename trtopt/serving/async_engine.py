"""AsyncLLMEngine: the synchronous LLMEngine driven by one background thread, fed by asyncio callers.

One thread owns the stepping (engine.step() runs torch and would block the event loop). Every touch of the
engine happens under one lock: adds run in a worker thread (so a slow tokenizer never stalls the event loop),
aborts are queued and applied by the step thread before its next step (so a cancelled coroutine can request one
without awaiting). Each request gets an asyncio.Queue; the step thread hands outputs to it through
loop.call_soon_threadsafe.

Failure isolation (DESIGN.md §7): a RequestError from add_request reaches only its caller; an executor failure
ends only the requests of that step (the engine frees their blocks) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from typing import Any, AsyncIterator

from trtopt.runtime.batch import EngineStats, RequestOutput
from trtopt.runtime.engine import LLMEngine, PromptType
from trtopt.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# How long the idle step thread sleeps before re-checking its stop flag (it is woken at once by new work).
_IDLE_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, or crashed); the server reports 503."""


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it before the end aborts the request."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()  # RequestOutput items, or an exception that ends the stream
        self._loop = asyncio.get_running_loop()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it finished (its KV blocks are freed before the next step)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the step thread."""
        # The loop may be closed already (a client that went away with its event loop); nothing waits then.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


class AsyncLLMEngine:
    """Async front of an LLMEngine. Create it, then `async for out in engine.generate(...)`.

    The step thread starts on first use (or with start()); stop() ends it and fails the open streams.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards every call into self.engine
        self._wake = threading.Event()  # set when there is new work (an add or an abort)
        self._aborts: collections.deque[str] = collections.deque()  # ids to abort before the next step
        self._streams: dict[str, RequestStream] = {}  # open requests; touched under _lock
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()  # refreshed by the step thread; read lock-free by /metrics

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="trtopt-step-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step thread; open streams end with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for rid, stream in list(self._streams.items()):
                self.engine.abort(rid)
                stream.put(EngineDeadError("the server is shutting down"))
            self._streams.clear()
            self._stats = self.engine.stats()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of its last step (or the last add/abort when idle)."""
        return self._stats

    # ---- requests ----------------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> RequestStream:
        """Queue a request and return its stream. Raises RequestError (changing nothing) if it is invalid.

        The caller must close() the stream in a finally block: leaving early (a client disconnect, a
        cancellation) then aborts the request and frees its KV blocks.
        """
        if not self.is_running:
            self.start()
        stream = RequestStream(request_id, self)
        added = asyncio.get_running_loop().run_in_executor(None, self._add_locked, request_id, prompt, params, stream)
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # The caller went away while the add was queued; once it lands, abort it so no blocks leak.
            added.add_done_callback(lambda f: f.exception() is None and self.abort(request_id))
            raise
        self._wake.set()
        return stream

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Convenience: add_request, then yield its outputs until it finishes (aborting it if left early)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Ask the step thread to abort the request (non-blocking; safe from a cancelled coroutine)."""
        self._aborts.append(request_id)
        self._wake.set()

    def _add_locked(self, request_id: str, prompt: PromptType, params: SamplingParams, stream: RequestStream) -> None:
        with self._lock:
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            self.engine.add_request(request_id, prompt, params)  # raises RequestError, changing nothing
            self._streams[request_id] = stream
            self._stats = self.engine.stats()

    # ---- the step thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                self._apply_aborts()
                busy = self.engine.has_unfinished_requests()
                outputs = self._step() if busy else []
                self._stats = self.engine.stats()
                for out in outputs:
                    stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
            if not busy:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()  # cleared after the wait; the next pass re-checks the engine under the lock

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            self.engine.abort(rid)
            self._streams.pop(rid, None)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # the engine already ended that step's requests and freed their blocks
            log.exception("engine step failed")
            for rid in [r for r in self._streams if not self._is_alive(r)]:
                self._streams.pop(rid).put(RuntimeError(f"the model failed on a step of this request: {e}"))
            return []

    def _is_alive(self, request_id: str) -> bool:
        return any(r.parent_id == request_id for r in self.engine.scheduler.requests.values())

