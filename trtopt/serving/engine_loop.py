"""EngineLoop: one background thread that owns and steps an LLMEngine, so concurrent callers share engine steps.

Both front ends use it: the HTTP server (through AsyncLLMEngine, which turns callbacks into asyncio queues) and
the Triton Python-backend model (whose callbacks send Triton responses).

Only the step thread touches the engine. Callers queue adds and aborts; before every step the thread applies
all queued adds, then all queued aborts, so a new request joins the very next step (no caller can be starved
by a busy loop) and an abort always lands after the add it cancels. submit() returns a Future that carries the
add's RequestError back to its caller. Each request has one callback, called on the step thread with every
RequestOutput and, if the request dies without finishing, with an exception (then never again).

Failure isolation (DESIGN.md §7): a RequestError reaches only its caller; an executor failure ends only the
requests of that step (the engine frees their blocks) and the loop goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
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


@dataclasses.dataclass
class _Add:
    """A queued add_request, with the future that reports how it went."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    callback: OutputCallback
    done: concurrent.futures.Future  # result None once queued in the engine; RequestError if it was invalid


class EngineLoop:
    """Owns the stepping of one LLMEngine. start() it, submit()/add() requests, stop() it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # touched only by the step thread once start() ran
        self._wake = threading.Event()  # set when there is new work (an add or an abort)
        self._adds: collections.deque[_Add] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._callbacks: dict[str, OutputCallback] = {}  # open requests; step thread only
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopping = False
        self._stats = engine.stats()  # refreshed by the step thread; read lock-free by metrics endpoints
        self.last_step_requests = 0  # requests that advanced together in the last step (evidence of batching)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="trtopt-step-loop", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step thread; open and queued requests are aborted and told with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        dead = EngineDeadError("the server is shutting down")
        while self._adds:
            add = self._adds.popleft()
            if add.done.set_running_or_notify_cancel():
                add.done.set_exception(dead)
        for rid, callback in list(self._callbacks.items()):
            self.engine.abort(rid)
            _call(callback, dead)
        self._callbacks.clear()
        self._stats = self.engine.stats()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or the last add/abort when idle)."""
        return self._stats

    # ---- requests ----------------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: PromptType, params: SamplingParams,
               callback: OutputCallback) -> concurrent.futures.Future:
        """Queue a request for the next step. The future fails with RequestError (nothing queued) if it is invalid."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            done.set_exception(EngineDeadError("the server is shutting down"))
            return done
        self._adds.append(_Add(request_id, prompt, params, callback, done))
        self._wake.set()
        return done

    def add(self, request_id: str, prompt: PromptType, params: SamplingParams, callback: OutputCallback) -> None:
        """submit() and wait until the request is queued (at most one step). Raises RequestError if invalid."""
        self.submit(request_id, prompt, params, callback).result()

    def abort(self, request_id: str) -> None:
        """Abort the request before the next step (non-blocking). Its callback is not called again."""
        self._aborts.append(request_id)
        self._wake.set()

    # ---- the step thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._apply_adds()
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
            if not busy and not self._adds and not self._aborts:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()  # cleared after the wait: the next pass re-checks both queues

    def _apply_adds(self) -> None:
        while self._adds:
            add = self._adds.popleft()
            if not add.done.set_running_or_notify_cancel():
                continue  # the caller cancelled before the add landed: never start it
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
            except Exception as e:  # RequestError for bad input; anything else is reported to that caller too
                add.done.set_exception(e)
                continue
            self._callbacks[add.request_id] = add.callback
            add.done.set_result(None)

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
