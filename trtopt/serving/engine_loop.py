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

Sleep (vLLM's POST /sleep, /wake_up; docs/architecture.md, "Serving"): sleep() and wake_up() are messages too,
applied by the step thread between steps. Asleep, the thread steps nothing and applies no add: adds queue and land,
in order, at wake-up (an abort lands at once if its request is in the engine, else after its add). The in-flight
requests, by `mode`: "abort" ends them now (their callbacks get RequestAbortedError, their blocks are freed),
"wait" lets them finish first (new adds queue meanwhile), "keep" freezes them in the engine until wake-up. Level 0
only pauses; level 1 also frees the KV pools' memory (LLMEngine.release_kv_cache: no request may hold a block, so
not with "keep"), and the weights stay where they are: its tags are "weights" and "kv_cache", level 0's
"scheduling". wake_up(tags) wakes those parts (None: all; the pools come back with "kv_cache"), and generation
resumes once no part sleeps. Level 2 (discard the weights) is refused: a plan's weights cannot be reloaded in place.

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

from trtopt.errors import RequestError
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

SLEEP_MODES = ("abort", "wait", "keep")  # what sleep() does with in-flight requests (vLLM's PauseMode)
# The parts of a sleeping engine wake_up(tags) names (vLLM's tags): level 0 pauses "scheduling", level 1 the rest.
SLEEP_TAGS = {0: frozenset({"scheduling"}), 1: frozenset({"weights", "kv_cache"})}
WAKE_TAGS = frozenset().union(*SLEEP_TAGS.values())


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, shutting down, or its engine broke); servers report 503."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with finish_reason="error" (its own fault, or the executor's on its step)."""


class RequestAbortedError(RuntimeError):
    """The server put the engine to sleep in "abort" mode while this request ran; send it again after wake-up."""


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
class _Control:
    """A queued sleep or wake-up, with the future that completes when the step thread has applied it."""

    sleep_level: int | None  # sleep(level); None: wake_up
    mode: str = "abort"  # sleep: SLEEP_MODES
    tags: frozenset[str] | None = None  # wake_up: the parts to wake; None: all
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


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
        self._max_logprobs = engine.input_processor.limits.max_logprobs
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
        # Sleep. _controls is guarded by _lock; the rest is the step thread's, read lock-free elsewhere.
        self._controls: collections.deque[_Control] = collections.deque()
        self._draining: _Control | None = None  # a "wait" sleep waiting for the engine's requests to finish
        self._sleep_level: int | None = None  # None while awake
        self._sleeping_tags: frozenset[str] = frozenset()  # the parts wake_up has not woken yet
        self._kv_releasable = engine.spec is None  # LLMEngine.release_kv_cache refuses a speculative engine
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

    # ---- sleep ---------------------------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """A sleep was applied (a "wait" one included, while it drains) and some part has not woken yet."""
        return self._draining is not None or bool(self._sleeping_tags)

    @property
    def sleep_level(self) -> int | None:
        """The level the engine sleeps at, None while awake (or draining toward a "wait" sleep)."""
        return self._sleep_level

    def sleep(self, level: int = 1, mode: str = "abort") -> concurrent.futures.Future:
        """Put the engine to sleep before the next step (see the module docstring). The future completes when it
        sleeps ("wait": once its requests finished). RequestError now for what cannot be done, changing nothing: a
        level other than 0 and 1, an unknown mode, "keep" at level 1, level 1 with speculative decoding."""
        if level not in SLEEP_TAGS:
            raise RequestError(f"sleep level {level} is not supported: level 0 pauses generation, level 1 also frees "
                               "the KV cache; level 2 would discard the weights, which a trtopt plan cannot reload "
                               "in place.")
        if mode not in SLEEP_MODES:
            raise RequestError(f"sleep mode {mode!r} is not one of {', '.join(SLEEP_MODES)}.")
        if level >= 1 and mode == "keep":
            raise RequestError('sleep mode "keep" keeps the requests\' KV blocks, which level 1 frees; use mode '
                               '"abort" or "wait", or level 0.')
        if level >= 1 and not self._kv_releasable:
            raise RequestError("sleep level 1 (freeing the KV cache) is not supported with speculative decoding; "
                               "use level 0.")
        return self._control(_Control(level, mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> concurrent.futures.Future:
        """Wake the parts `tags` of a sleeping engine (None: all) before the next step; generation resumes once
        none sleeps. A tag that is not sleeping is ignored, as is waking an awake engine. RequestError for an
        unknown tag."""
        unknown = sorted(set(tags or ()) - WAKE_TAGS)
        if unknown:
            raise RequestError(f"unknown wake-up tag(s) {unknown}; the tags are {', '.join(sorted(WAKE_TAGS))} "
                               "(none: wake everything).")
        return self._control(_Control(None, tags=None if tags is None else frozenset(tags)))

    def _control(self, control: _Control) -> concurrent.futures.Future:
        with self._lock:
            if self._closed is not None:
                control.done.set_exception(EngineDeadError(self._closed))
                return control.done
            self._controls.append(control)
        self._wake.set()
        return control.done

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

    @property
    def max_logprobs(self) -> int:
        """Alternatives per token a request may ask for (EngineConfig.max_logprobs, -1 resolved to the vocabulary)."""
        return self._max_logprobs

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
                self._apply_controls()
                if self._sleeping_tags:  # asleep: nothing runs; kept requests may still be aborted
                    self._apply_aborts(in_engine_only=True)
                    self._stats = self._engine.stats()
                    self._idle_wait()
                    continue
                if self._draining is None:  # a "wait" sleep lets the requests in the engine finish, adds wait
                    self._apply_adds()
                self._apply_aborts()
                busy = self._engine.has_unfinished_requests()
                outputs = self._engine.step() if busy else []
                self._stats = self._engine.stats()  # before delivering: a caller that saw its output sees these
                self._deliver(outputs)
                if self._draining is not None and not self._engine.has_unfinished_requests():
                    draining, self._draining = self._draining, None
                    self._fall_asleep(draining)
                    continue
                if self._engine.num_consecutive_failed_steps >= self.max_consecutive_failed_steps:
                    reason = (f"the model failed on {self._engine.num_consecutive_failed_steps} steps in a row; "
                              "the engine is broken and must be restarted")
                    break
                if not busy:
                    with self._lock:
                        idle = not self._adds and not self._aborts and not self._controls and self._closed is None
                    if idle:
                        self._idle_wait()
        except Exception as e:  # an engine bug (a broken invariant): its state is unknown, so nothing runs again
            log.exception("the engine failed outside any request; stopping the loop")
            reason = f"the engine failed: {type(e).__name__}: {e}"
        finally:
            self._shut_down(reason)

    def _idle_wait(self) -> None:
        self._wake.wait(_IDLE_WAIT_S)
        self._wake.clear()  # cleared after the wait: the next pass re-checks every queue

    def _apply_controls(self) -> None:
        with self._lock:
            controls, self._controls = self._controls, collections.deque()
        for control in controls:
            if not control.done.set_running_or_notify_cancel():
                continue
            try:
                if control.sleep_level is None:
                    self._wake_parts(control.tags)
                    control.done.set_result(None)
                else:
                    self._sleep(control)
            except Exception as e:  # RequestError for what this engine cannot do; the loop goes on
                if not control.done.done():
                    control.done.set_exception(e)

    def _sleep(self, control: _Control) -> None:
        level = control.sleep_level
        if self._draining is not None or self._sleeping_tags:
            current = self._draining.sleep_level if self._draining is not None else self._sleep_level
            if level > current:
                raise RequestError(f"the engine already sleeps at level {current}; wake it up (POST /wake_up) "
                                   f"before sleeping at level {level}.")
            control.done.set_result(None)  # as deep already
            return
        if control.mode == "abort":
            self._abort_all()
        if control.mode == "wait" and self._engine.has_unfinished_requests():
            self._draining = control  # completed by _fall_asleep once they finished
            return
        self._fall_asleep(control)

    def _fall_asleep(self, control: _Control) -> None:
        """Sleep now: every request in the engine has finished or was aborted ("keep": they stay, at level 0)."""
        if control.done.done():  # a stop() that timed out answered it already
            return
        try:
            if control.sleep_level >= 1:
                self._engine.release_kv_cache()
        except Exception as e:
            control.done.set_exception(e)  # still awake: nothing was released
            return
        self._sleep_level = control.sleep_level
        self._sleeping_tags = SLEEP_TAGS[control.sleep_level]
        self._stats = self._engine.stats()
        control.done.set_result(None)
        log.info("the engine sleeps (level %d, mode %s)", control.sleep_level, control.mode)

    def _wake_parts(self, tags: frozenset[str] | None) -> None:
        if self._draining is not None:  # a "wait" sleep that has not begun: it never will
            draining, self._draining = self._draining, None
            if not draining.done.done():
                draining.done.set_exception(RequestError("a wake-up cancelled this sleep before the running requests "
                                                         "finished; the engine stayed awake."))
        waking = self._sleeping_tags if tags is None else self._sleeping_tags & tags
        if "kv_cache" in waking:
            self._engine.restore_kv_cache()
        self._sleeping_tags -= waking
        if not self._sleeping_tags and self._sleep_level is not None:
            self._sleep_level = None
            log.info("the engine is awake")

    def _abort_all(self) -> None:
        """Sleep's "abort" mode: end every request in the engine now; each caller gets RequestAbortedError."""
        with self._deliver_lock:
            callbacks, self._callbacks = self._callbacks, {}
        for rid in callbacks:
            self._abort(rid)
        error = RequestAbortedError("the server was put to sleep (POST /sleep) and aborted this request; send it "
                                    "again once the server is awake (POST /wake_up).")
        for callback in callbacks.values():
            _call(callback, error)

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

    def _apply_aborts(self, *, in_engine_only: bool = False) -> None:
        """in_engine_only (asleep, no add applied): an abort of a request still queued stays queued, so that it
        lands after its add."""
        with self._lock:
            aborts, self._aborts = self._aborts, collections.deque()
        if in_engine_only:
            with self._deliver_lock:
                in_engine = set(self._callbacks)
            later = [rid for rid in aborts if rid not in in_engine]
            aborts = collections.deque(rid for rid in aborts if rid in in_engine)
            with self._lock:
                self._aborts.extendleft(reversed(later))  # before any abort queued meanwhile
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
        """Answer every add, sleep and wake-up that has not reached the engine (safe from any thread: it does not
        touch the engine)."""
        with self._lock:
            adds, self._adds = self._adds, collections.deque()
            controls, self._controls = self._controls, collections.deque()
            draining, self._draining = self._draining, None
        for add in adds:
            if add.done.set_running_or_notify_cancel():
                add.done.set_exception(error)
        for control in controls:
            if control.done.set_running_or_notify_cancel():
                control.done.set_exception(error)
        if draining is not None and not draining.done.done():
            draining.done.set_exception(error)


def _call(callback: OutputCallback, item: RequestOutput | BaseException) -> None:
    # A callback that raises must not kill the loop that every other request depends on.
    try:
        callback(item)
    except Exception:
        log.exception("an output callback raised; the step loop goes on")
