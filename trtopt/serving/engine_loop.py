"""EngineLoop: one background thread that owns and steps an LLMEngine, so concurrent callers share engine steps.

Both front ends use it: the HTTP server (through AsyncLLMEngine, which turns callbacks into asyncio queues) and
the Triton Python-backend model (whose callbacks send Triton responses).

One door (docs/architecture.md §6): a front end calls prepare() on its own thread, which tokenizes the prompt,
checks it and the params against the engine's limits and compiles the request's structured-output grammar, and
submits the PreparedRequest; the step thread, which every running request waits on, only queues it in the engine
(whose compile of the grammar then returns the one the PreparedRequest holds). The facts a front end needs about the
engine (tokenizer, max_model_len, vocab_size, eos_token_ids, tokenize()) are read-only properties of the loop: no
front end reaches the engine itself.

One owner (docs/architecture.md, "Serving"; vLLM's EngineCore busy loop and SGLang's scheduler process are the
models): once start() ran, only the step thread touches the engine, for adds, aborts, steps and shutdown alike.
Callers queue adds and aborts under a lock; before every step the thread applies all queued adds, then all queued
aborts, so a new request joins the very next step and an abort always lands after the add it cancels. submit()
returns a Future that carries the add's RequestError back to its caller. Each request has one callback, called on
the step thread with every RequestOutput and, if the request dies without finishing, with an exception (then
never again): RequestFailedError when the engine ended it with finish_reason="error", EngineDeadError when the
loop stopped under it.

Stopping: stop() closes the loop to new work (a later submit() fails at once with EngineDeadError) and asks the
thread to finish; the thread aborts what is in flight and answers every queued add and every callback. The caller
waits at most `timeout` (5 s by default) and never touches the engine; if the thread is stuck in a step past the
timeout, the caller answers the queued adds and the callbacks itself (no engine access), and the thread frees the
requests' blocks if its step ever returns. A stopped loop never starts again.

A broken engine: MAX_CONSECUTIVE_FAILED_STEPS executor failures in a row, or any exception that escapes
LLMEngine.step (an engine bug), stop the loop the same way, with `dead_reason` set: servers turn /health to 503
and `trtopt serve` exits non-zero so a supervisor restarts it. A single failing step is never retried: the engine
already ended its requests.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, Sequence

from trtopt.runtime.batch import EngineStats, RequestOutput
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.input_processor import ProcessedPrompt, PromptType
from trtopt.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# How long the idle step thread sleeps before re-checking its stop flag (new work wakes it at once).
_IDLE_WAIT_S = 0.5
# Executor failures in a row after which the engine counts as broken. One failure can be one bad request's shape
# hitting a kernel bug; three in a row, each with the previous step's requests already gone, is the device or
# the model, and retrying would only fail every new request too.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# stop() waits this long for the step thread (mid-step included) before answering its callers itself.
DEFAULT_STOP_TIMEOUT_S = 5.0

OutputCallback = Callable[[RequestOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, shutting down, or its engine broke); servers report 503."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with finish_reason="error" (its own fault, or the executor's on its step)."""


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request made ready by EngineLoop.prepare on the caller's thread; the step thread only queues it."""

    prompt: ProcessedPrompt  # token ids, the output budget and bad_words as ids, checked against the engine's limits
    params: SamplingParams  # checked against the plan (n, top_k, token ids in the vocabulary)
    # The compiled structured-output grammar (xgrammar's CompiledGrammar), None without structured_outputs; the step
    # thread hands it to add_request, which then compiles nothing.
    grammar: Any = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt.prompt_token_ids


@dataclasses.dataclass
class _Add:
    """A queued add_request, with the future that reports how it went."""

    request_id: str
    request: PreparedRequest
    callback: OutputCallback
    done: concurrent.futures.Future  # result None once queued in the engine; RequestError if it was invalid


class EngineLoop:
    """Owns the stepping of one LLMEngine. start() it, prepare() and submit()/add() requests, stop() it (once)."""

    def __init__(self, engine: LLMEngine, *, max_consecutive_failed_steps: int = MAX_CONSECUTIVE_FAILED_STEPS) -> None:
        # Touched only by the step thread once start() ran, but for prepare()'s two thread-safe calls: its
        # InputProcessor (stateless) and compile_grammar (locked; cached per spec).
        self._engine = engine
        self._processor = engine.input_processor
        self._tokenizer = engine.tokenizer
        self._max_model_len = engine.limits.max_model_len
        self._vocab_size = engine.plan.model.vocab_size
        self._eos_token_ids = tuple(engine.plan.model.eos_token_ids)
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self._wake = threading.Event()  # set when there is new work (an add or an abort) or a stop
        self._lock = threading.Lock()  # guards _adds, _aborts, _closed, _thread, dead_reason
        self._adds: collections.deque[_Add] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._closed: str | None = None  # why the loop takes no more work; set once, never cleared
        self.dead_reason: str | None = None  # set when the engine broke (not on a clean stop)
        self._thread: threading.Thread | None = None
        # Callbacks of the requests in the engine. The step thread delivers under _deliver_lock; a stop() whose
        # join timed out takes them over under it (then _orphaned is True and the thread delivers nothing more).
        self._deliver_lock = threading.RLock()  # re-entrant: a callback may call abort()
        self._callbacks: dict[str, OutputCallback] = {}
        self._orphaned: list[str] = []  # ids the caller answered; the thread still frees their blocks
        self.stopped = threading.Event()  # set once the step thread has exited and answered everything
        self._stats = engine.stats()  # refreshed by the step thread; read lock-free by metrics endpoints
        self.last_step_requests = 0  # requests that advanced together in the last step (evidence of batching)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent while running). A stopped loop never starts again: EngineDeadError."""
        with self._lock:
            if self._closed is not None:
                raise EngineDeadError(f"the engine loop was stopped ({self._closed}); it does not start again.")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtopt-step-loop", daemon=True)
                self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Stop taking work and let the step thread abort what is in flight and answer everyone (EngineDeadError).

        Returns within about `timeout` seconds and never touches the engine. True if the thread finished; False if
        it was stuck in a step, in which case every caller has been answered from here anyway.
        """
        with self._lock:
            if self._closed is None:
                self._closed = "the server is shutting down"
            thread = self._thread
        self._wake.set()
        if thread is None:  # never started: nothing reached the engine
            self._fail_queued(EngineDeadError(self._closed))
            self.stopped.set()
            return True
        if thread is threading.current_thread():
            return False  # called from a callback: the thread shuts down when the callback returns
        thread.join(timeout)
        if not thread.is_alive():
            return True
        log.error("the step thread did not finish within %.1f s (stuck in a step); answering its requests without it",
                  timeout)
        dead = EngineDeadError(f"{self._closed}; the engine did not stop in time")
        self._fail_queued(dead)
        if not self._deliver_lock.acquire(timeout=1.0):
            log.error("a callback holds the delivery lock; in-flight requests are left to the step thread")
            return False
        try:
            taken, self._callbacks = self._callbacks, {}
            self._orphaned.extend(taken)
        finally:
            self._deliver_lock.release()
        for callback in taken.values():
            _call(callback, dead)
        return False

    @property
    def is_running(self) -> bool:
        """The step thread is alive and the loop takes work."""
        return self._thread is not None and self._thread.is_alive() and self._closed is None

    @property
    def is_healthy(self) -> bool:
        """False once the engine broke (see dead_reason); a cleanly stopped loop stays healthy."""
        return self.dead_reason is None

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or the last add/abort when idle)."""
        return self._stats

    # ---- what front ends may know of the engine (fixed at construction; any thread) ------------------------

    @property
    def tokenizer(self) -> Any:
        """The plan's HF tokenizer, or None for a plan without tokenizer files."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of any prompt form, chat messages rendered with the plan's chat
        template; on the caller's thread. RequestError if the prompt is unusable."""
        return self._processor.tokenize(prompt)

    # ---- requests ----------------------------------------------------------------------------------------

    def prepare(self, prompt: PromptType, params: SamplingParams) -> PreparedRequest:
        """Tokenize `prompt`, check it and `params` against the engine's limits, and compile the request's grammar,
        all on the caller's thread (a grammar takes milliseconds to seconds; the step thread never waits for it).
        Raises RequestError, as add_request would for the same input."""
        return self.prepare_batch([prompt], params)[0]

    def prepare_batch(self, prompts: Sequence[PromptType], params: SamplingParams) -> list[PreparedRequest]:
        """prepare() for prompts that share `params` (a batched completion): every prompt is checked first, then
        the one grammar is compiled."""
        processed = [self._processor.process(prompt, params) for prompt in prompts]
        grammar = self._engine.compile_grammar(params)  # thread-safe (LLMEngine.compile_grammar)
        return [PreparedRequest(p, params, grammar) for p in processed]

    def submit(self, request_id: str, request: PreparedRequest, callback: OutputCallback) -> concurrent.futures.Future:
        """Queue a prepared request for the next step. The future fails with RequestError (nothing queued) if the
        engine refuses it (a request id in use), and at once with EngineDeadError if the loop is stopping, stopped
        or dead."""
        assert isinstance(request, PreparedRequest), f"submit() takes a PreparedRequest, got {type(request).__name__}"
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                done.set_exception(EngineDeadError(self._closed))
                return done
            self._adds.append(_Add(request_id, request, callback, done))
        self._wake.set()
        return done

    def add(self, request_id: str, request: PreparedRequest, callback: OutputCallback) -> None:
        """submit() and wait until the request is queued (at most one step). Raises RequestError if refused."""
        self.submit(request_id, request, callback).result()

    def abort(self, request_id: str) -> None:
        """Abort the request before the next step (non-blocking). Its callback is not called again."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # ---- the step thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        reason = None
        try:
            while self._closed is None:
                self._apply_adds()
                self._apply_aborts()
                busy = self._engine.has_unfinished_requests()
                outputs = self._engine.step() if busy else []
                self._stats = self._engine.stats()  # before delivering: a caller that saw its output sees these
                self._deliver(outputs)
                if self._engine.num_consecutive_failed_steps >= self.max_consecutive_failed_steps:
                    reason = (f"the model failed on {self._engine.num_consecutive_failed_steps} steps in a row; "
                              "the engine is broken and must be restarted")
                    break
                if not busy:
                    with self._lock:
                        idle = not self._adds and not self._aborts and self._closed is None
                    if idle:
                        self._wake.wait(_IDLE_WAIT_S)
                        self._wake.clear()  # cleared after the wait: the next pass re-checks both queues
        except Exception as e:  # an engine bug (a broken invariant): its state is unknown, so nothing runs again
            log.exception("the engine failed outside any request; stopping the loop")
            reason = f"the engine failed: {type(e).__name__}: {e}"
        finally:
            self._shut_down(reason)

    def _apply_adds(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, collections.deque()
        for add in adds:
            if not add.done.set_running_or_notify_cancel():
                continue  # the caller cancelled before the add landed: never start it
            try:
                # A ProcessedPrompt passes the input processor unchanged, and the request brings its compiled
                # grammar: nothing is tokenized or compiled here.
                self._engine.add_request(add.request_id, add.request.prompt, add.request.params,
                                         grammar=add.request.grammar)
            except Exception as e:  # RequestError for bad input; anything else is reported to that caller too
                add.done.set_exception(e)
                continue
            with self._deliver_lock:
                self._callbacks[add.request_id] = add.callback
            add.done.set_result(None)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, collections.deque()
        for rid in aborts:
            self._abort(rid)
            with self._deliver_lock:
                self._callbacks.pop(rid, None)

    def _abort(self, request_id: str) -> None:
        # Nothing one request does may end the thread every other request depends on.
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("aborting %s failed; the step loop goes on", request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.last_step_requests = len(outputs)
        with self._deliver_lock:
            if self._orphaned:
                return  # stop() answered every caller already
            for out in outputs:
                if out.finished:
                    callback = self._callbacks.pop(out.request_id, None)
                else:
                    callback = self._callbacks.get(out.request_id)
                if callback is not None:
                    _call(callback, out if out.error is None else RequestFailedError(out.error))

    def _shut_down(self, reason: str | None) -> None:
        """On the step thread, last: abort everything in flight and answer every queued add and callback."""
        with self._lock:
            if self._closed is None:
                self._closed = reason or "the server is shutting down"
            if reason is not None:
                self.dead_reason = reason
                log.error("engine loop stopped: %s", reason)
        dead = EngineDeadError(self._closed)
        self._fail_queued(dead)
        self._apply_aborts()
        with self._deliver_lock:
            callbacks, self._callbacks = self._callbacks, {}
            orphaned = list(self._orphaned)
        for rid in (*callbacks, *orphaned):
            self._abort(rid)  # frees its blocks: the engine stays consistent for whoever inspects it
        for callback in callbacks.values():
            _call(callback, dead)
        try:
            self._stats = self._engine.stats()
        except Exception:
            log.exception("reading the engine's stats at shutdown failed")
        self.stopped.set()

    def _fail_queued(self, error: EngineDeadError) -> None:
        """Answer every add that has not reached the engine (safe from any thread: it does not touch the engine)."""
        with self._lock:
            adds, self._adds = self._adds, collections.deque()
        for add in adds:
            if add.done.set_running_or_notify_cancel():
                add.done.set_exception(error)


def _call(callback: OutputCallback, item: RequestOutput | BaseException) -> None:
    # A callback that raises must not kill the loop that every other request depends on.
    try:
        callback(item)
    except Exception:
        log.exception("an output callback raised; the step loop goes on")
