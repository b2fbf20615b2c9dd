"""EngineLoop: one background thread that steps an LLMEngine, so concurrent callers share engine steps.

Both front ends use it: the HTTP server (through AsyncLLMEngine, which turns callbacks into asyncio queues) and
the Triton Python-backend model (whose callbacks send Triton responses).

Every touch of the engine happens under one lock. add() takes the lock itself (callers that must not block run
it in a worker thread); abort() only queues the id, and the step thread applies it before its next step, so a
cancelled caller never waits. Each request has one callback, called on the step thread with every
RequestOutput and, if the request dies without finishing, with an exception (then never again).

Failure isolation (DESIGN.md §7): a RequestError from add() reaches only its caller; an executor failure ends
only the requests of that step (the engine frees their blocks) and the loop goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from trtopt.runtime.batch import EngineStats, RequestOutput
from trtopt.runtime.engine import LLMEngine, PromptType
from trtopt.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# How long the idle step thread sleeps before re-checking its stop flag (new work wakes it at once).
_IDLE_WAIT_S = 0.5

OutputCallback = Callable[[RequestOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, or shutting down); servers report 503."""


class EngineLoop:
    """Owns the stepping of one LLMEngine. start() it, add() requests, stop() it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards every call into self.engine and self._callbacks
        self._wake = threading.Event()  # set when there is new work (an add or an abort)
        self._aborts: collections.deque[str] = collections.deque()  # ids to abort before the next step
        self._callbacks: dict[str, OutputCallback] = {}  # open requests
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()  # refreshed by the step thread; read lock-free by metrics endpoints
        self.last_step_requests = 0  # requests that advanced together in the last step (evidence of batching)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="trtopt-step-loop", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step thread; open requests are aborted and their callbacks get EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for rid, callback in list(self._callbacks.items()):
                self.engine.abort(rid)
                _call(callback, EngineDeadError("the server is shutting down"))
            self._callbacks.clear()
            self._stats = self.engine.stats()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or the last add/abort when idle)."""
        return self._stats

    # ---- requests ----------------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: PromptType, params: SamplingParams, callback: OutputCallback) -> None:
        """Queue a request (blocks while a step runs). Raises RequestError, changing nothing, if it is invalid."""
        with self._lock:
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            self.engine.add_request(request_id, prompt, params)
            self._callbacks[request_id] = callback
            self._stats = self.engine.stats()
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort the request before the next step (non-blocking). Its callback is not called again."""
        self._aborts.append(request_id)
        self._wake.set()

    # ---- the step thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                self._apply_aborts()
                busy = self.engine.has_unfinished_requests()
                outputs = self._step() if busy else []
                self._stats = self.engine.stats()
                if outputs:
                    self.last_step_requests = len(outputs)
                for out in outputs:
                    callback = self._callbacks.pop(out.request_id) if out.finished else self._callbacks.get(out.request_id)
                    if callback is not None:
                        _call(callback, out)
            if not busy:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()  # cleared after the wait: the next pass re-checks the engine under the lock

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            self.engine.abort(rid)
            self._callbacks.pop(rid, None)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # the engine already ended that step's requests and freed their blocks
            log.exception("engine step failed")
            for rid in [r for r in self._callbacks if not self._is_alive(r)]:
                _call(self._callbacks.pop(rid), RuntimeError(f"the model failed on a step of this request: {e}"))
            return []

    def _is_alive(self, request_id: str) -> bool:
        return any(r.parent_id == request_id for r in self.engine.scheduler.requests.values())


def _call(callback: OutputCallback, item: RequestOutput | BaseException) -> None:
    # A callback that raises must not kill the loop that every other request depends on.
    try:
        callback(item)
    except Exception:
        log.exception("an output callback raised; the step loop goes on")
