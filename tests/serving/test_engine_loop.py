"""EngineLoop / AsyncLLMEngine on a tiny counting executor (no model): batching across callers, abort on early
exit, failure isolation, and no leaked KV blocks. Fast and in-process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.errors import RequestError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.async_engine import AsyncLLMEngine
from trtopt.serving.engine_loop import MAX_CONSECUTIVE_FAILED_STEPS, EngineDeadError, EngineLoop, RequestFailedError

VOCAB = 50
POISON = 13  # a step that contains this token id fails, as a broken kernel would


class CountingExecutor(Executor):
    """Greedy next token = previous token + 1 (mod VOCAB); raises on any step that holds POISON."""

    def __init__(self) -> None:
        self.step_sizes: list[int] = []  # sequences per step
        self.in_step = threading.Event()  # set while execute() runs
        self.gate = threading.Event()  # execute() waits for it: tests hold a step open to queue work behind it
        self.gate.set()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def copy_blocks(self, pairs) -> None:
        assert all(s != 0 and d != 0 for s, d in pairs), "copy_blocks touched the null block"

    def execute(self, step: StepInputs) -> torch.Tensor:
        self.in_step.set()
        self.gate.wait(30)
        self.in_step.clear()
        ids = step.input_ids[0]
        if (ids == POISON).any():
            raise RuntimeError("injected executor failure")
        self.step_sizes.append(step.num_seqs)
        time.sleep(0.002)  # a step takes time, as a model's does (and releases the GIL, as torch does)
        last = ids[step.logits_indices]  # [N]
        return torch.nn.functional.one_hot((last + 1) % VOCAB, VOCAB).float() * 10  # [N, VOCAB]


def make_engine(num_blocks: int = 32) -> tuple[LLMEngine, CountingExecutor]:
    plan = PlanConfig(
        model=ModelFacts(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, vocab_size=VOCAB, dtype="float32",
                         eos_token_ids=(VOCAB - 1,)),
        limits=Limits(block_size=4, max_num_tokens=64, max_num_seqs=8, max_model_len=64),
    )
    executor = CountingExecutor()
    return LLMEngine(executor, plan, None, EngineConfig(num_blocks=num_blocks)), executor


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def _tokens(engine: AsyncLLMEngine, rid: str, prompt: list[int], params=GREEDY) -> list[int]:
    outs = [out async for out in engine.generate(rid, {"prompt_token_ids": prompt}, params)]
    return outs[-1].outputs[0].token_ids


def test_concurrent_requests_share_steps_and_free_blocks():
    engine, executor = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        return await asyncio.gather(*(_tokens(aengine, f"r{i}", [i + 1, i + 2]) for i in range(5)))

    try:
        results = asyncio.run(main())
    finally:
        aengine.stop()
    assert results == [[(i + 3 + k) % VOCAB for k in range(6)] for i in range(5)]
    assert max(executor.step_sizes) == 5, "the five requests ran in the same steps"
    assert aengine.stats().num_blocks_free == aengine.stats().num_blocks_total


def test_leaving_early_aborts_and_frees_blocks():
    engine, _ = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        seen = 0
        async for _ in aengine.generate("long", {"prompt_token_ids": [1, 2, 3]}, long):
            seen += 1
            if seen == 2:
                break
        other = await _tokens(aengine, "after", [5])  # runs after the abort was applied
        return seen, other

    try:
        seen, other = asyncio.run(main())
        stats = aengine.stats()
    finally:
        aengine.stop()
    assert seen == 2 and other == [6, 7, 8, 9, 10, 11]
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == 0


def test_a_failing_step_ends_only_its_request():
    engine, _ = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        with pytest.raises(RuntimeError, match="injected executor failure"):
            await _tokens(aengine, "bad", [POISON, 1])
        return await _tokens(aengine, "good", [20])

    try:
        good = asyncio.run(main())
        stats = aengine.stats()
        assert aengine.is_running
    finally:
        aengine.stop()
    assert good == [21, 22, 23, 24, 25, 26]
    assert stats.num_blocks_free == stats.num_blocks_total


def test_invalid_request_raises_to_its_caller_only():
    engine, _ = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        with pytest.raises(RequestError, match="vocabulary"):
            await aengine.add_request("oov", {"prompt_token_ids": [VOCAB + 5]}, GREEDY)
        with pytest.raises(RequestError, match="already in use"):
            await asyncio.gather(_tokens(aengine, "dup", [1]), _tokens(aengine, "dup", [2]))
        return await _tokens(aengine, "fine", [3])

    try:
        assert asyncio.run(main()) == [4, 5, 6, 7, 8, 9]
    finally:
        aengine.stop()


def test_a_raising_callback_does_not_stop_the_loop():
    engine, _ = make_engine()
    loop = EngineLoop(engine)
    loop.start()
    done = threading.Event()
    got: list = []

    def explode(_item) -> None:
        raise ValueError("a buggy front end")

    def collect(item) -> None:
        got.append(item)
        if item.finished:
            done.set()

    try:
        loop.add("a", loop.prepare({"prompt_token_ids": [1]}, GREEDY), explode)
        loop.add("b", loop.prepare({"prompt_token_ids": [2]}, GREEDY), collect)
        assert done.wait(30), "request b never finished"
    finally:
        loop.stop()
    assert got[-1].outputs[0].token_ids == [3, 4, 5, 6, 7, 8]
    assert loop.stats().num_blocks_free == loop.stats().num_blocks_total


def test_cancelling_a_queued_add_never_starts_it():
    engine, executor = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        executor.gate.clear()
        first = asyncio.ensure_future(_tokens(aengine, "first", [1]))
        while not executor.in_step.is_set():  # bounded by the gate's 30 s timeout in the worst case
            await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(aengine.add_request("gone", {"prompt_token_ids": [2]}, GREEDY))
        await asyncio.sleep(0.01)  # the add is queued behind the held step
        queued.cancel()
        executor.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await queued
        # Bounded: with a dead step thread these would wait forever.
        return await asyncio.wait_for(first, 30), await asyncio.wait_for(_tokens(aengine, "after", [7]), 30)

    try:
        first, after = asyncio.run(main())
        stats = aengine.stats()
        assert aengine.is_running, "a cancelled add must not kill the step thread"
    finally:
        aengine.stop()
    assert first == [2, 3, 4, 5, 6, 7] and after == [8, 9, 10, 11, 12, 13]
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == 0 and stats.num_waiting == 0


def test_batched_prompts_stream_together_all_or_none():
    engine, _ = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        with pytest.raises(RequestError, match="vocabulary"):
            await aengine.add_requests([("ok", {"prompt_token_ids": [1]}), ("bad", {"prompt_token_ids": [VOCAB]})],
                                       GREEDY)
        stream = await aengine.add_requests([("a", {"prompt_token_ids": [1]}), ("b", {"prompt_token_ids": [30]})],
                                            GREEDY)
        finals = {}
        try:
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        finally:
            stream.close()
        return finals

    try:
        finals = asyncio.run(main())
        stats = aengine.stats()
    finally:
        aengine.stop()
    assert finals == {"a": [2, 3, 4, 5, 6, 7], "b": [31, 32, 33, 34, 35, 36]}
    assert stats.num_blocks_free == stats.num_blocks_total


# ---- issue 10: one bad request hurts no one; one owner thread; a stopped or broken loop stays stopped -----------


def _poison_on_add(engine: LLMEngine, request_id: str, **fields) -> None:
    """After `request_id` is added (on the step thread), set sampling fields past validation, as a value that
    slipped through the edge would be (top_k=2**63 fits no int64 tensor)."""
    add = engine.add_request

    def add_then_poison(rid, prompt, params=None, **kw):
        add(rid, prompt, params, **kw)
        if rid == request_id:
            for seq in engine.output_processor.groups[rid].seqs:
                for k, v in fields.items():
                    object.__setattr__(seq.params, k, v)
                seq.params.__dict__.pop("plain_greedy", None)  # derived from the old values (cached)

    engine.add_request = add_then_poison


def test_a_request_whose_sampling_fails_ends_alone_and_the_others_finish():
    engine, _ = make_engine()
    _poison_on_add(engine, "poison", top_k=2**63)
    aengine = AsyncLLMEngine(engine)
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)

    async def main():
        jobs = [_tokens(aengine, f"r{i}", [i + 1]) for i in range(3)] + [_tokens(aengine, "poison", [9], sampled)]
        # Bounded: a step that is retried forever would starve every request.
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 20)

    try:
        results = asyncio.run(main())
        stats = aengine.stats()
        assert aengine.is_running and aengine.dead_reason is None
    finally:
        aengine.stop()
    assert results[:3] == [[(i + 2 + k) % VOCAB for k in range(6)] for i in range(3)]
    assert isinstance(results[3], RequestFailedError) and "sampling" in str(results[3])
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == 0


def _hold_a_step(loop: EngineLoop, executor: CountingExecutor, got: list) -> None:
    """Start a request and return while its step is held open in execute() (executor.gate)."""
    executor.gate.clear()
    loop.add("held", loop.prepare({"prompt_token_ids": [1]}, GREEDY), got.append)
    assert executor.in_step.wait(10), "the held step never started"


def test_aborting_an_n2_request_before_its_siblings_fork_keeps_the_loop_alive():
    engine, executor = make_engine()
    loop = EngineLoop(engine)
    loop.start()
    got: list = []
    try:
        _hold_a_step(loop, executor, got)
        two = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
        queued = loop.submit("pair", loop.prepare({"prompt_token_ids": [3, 4]}, two), got.append)
        loop.abort("pair")  # applied right after the add, before the pair is ever scheduled
        executor.gate.set()
        queued.result(10)
        done = threading.Event()
        after: list = []
        pair = loop.prepare({"prompt_token_ids": [3, 4]}, two)
        loop.add("pair", pair, lambda o: (after.append(o), o.finished and done.set()))
        assert done.wait(10), "the step thread died, or the id could not be reused"
        assert loop.is_running
    finally:
        loop.stop()
    assert [c.token_ids for c in after[-1].outputs] == [[5, 6, 7, 8, 9, 10]] * 2
    assert loop.stats().num_blocks_free == loop.stats().num_blocks_total and not engine.scheduler.requests


def test_stop_never_touches_the_engine_from_the_callers_thread_and_answers_everyone():
    engine, executor = make_engine()
    loop = EngineLoop(engine)
    callers: set[str] = set()  # threads that called into the engine
    for name in ("add_request", "abort", "step", "has_unfinished_requests", "stats"):
        method = getattr(engine, name)

        def spy(*a, _method=method, **kw):
            callers.add(threading.current_thread().name)
            return _method(*a, **kw)

        setattr(engine, name, spy)
    loop.start()
    got: list = []
    _hold_a_step(loop, executor, got)
    queued = loop.submit("queued", loop.prepare({"prompt_token_ids": [2]}, GREEDY), got.append)
    start = time.monotonic()
    finished = loop.stop(timeout=0.3)  # the step is stuck in execute(): the join times out
    took = time.monotonic() - start
    assert not finished and took < 3, f"stop() took {took:.1f} s"
    # Everyone is answered at once, by the caller, without the engine.
    assert isinstance(got[-1], EngineDeadError), got
    with pytest.raises(EngineDeadError):
        queued.result(0)
    late = loop.submit("late", loop.prepare({"prompt_token_ids": [2]}, GREEDY), got.append)
    with pytest.raises(EngineDeadError):
        late.result(0)  # already failed: no future that can never resolve
    executor.gate.set()  # the step returns; the thread frees the blocks and exits
    assert loop.stopped.wait(10)
    assert callers == {"trtopt-step-loop"}, f"the engine was touched from {callers - {'trtopt-step-loop'}}"
    assert len(got) == 1, "a request was answered twice"
    assert loop.stats().num_blocks_free == loop.stats().num_blocks_total and not engine.scheduler.requests
    with pytest.raises(EngineDeadError):
        loop.start()  # never again


def test_a_clean_stop_aborts_in_flight_requests_on_the_step_thread():
    engine, executor = make_engine()
    loop = EngineLoop(engine)
    loop.start()
    got: list = []
    _hold_a_step(loop, executor, got)
    threading.Timer(0.2, executor.gate.set).start()  # the step ends well within the stop timeout
    assert loop.stop(timeout=5)
    # The held step's token, then the end: the request was aborted on the step thread, not run to its end.
    assert isinstance(got[-1], EngineDeadError) and all(not isinstance(g, BaseException) for g in got[:-1])
    assert len(got) < 6
    assert loop.is_healthy and loop.stats().num_blocks_free == loop.stats().num_blocks_total


def test_submits_racing_a_stop_all_resolve():
    engine, _ = make_engine()
    loop = EngineLoop(engine)
    loop.start()
    futures: list = []
    answered: list = []

    def client(k: int) -> None:
        for i in range(150):
            futures.append(loop.submit(f"c{k}-{i}", loop.prepare({"prompt_token_ids": [1]}, GREEDY), answered.append))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.01)
    loop.stop()
    for t in threads:
        t.join()
    done, pending = concurrent.futures.wait(futures, timeout=10)
    assert not pending, f"{len(pending)} adds never resolved"
    assert all(f.exception() is None or isinstance(f.exception(), EngineDeadError) for f in done)
    assert loop.stats().num_blocks_free == loop.stats().num_blocks_total


def test_a_stopped_async_engine_is_never_restarted():
    engine, _ = make_engine()
    aengine = AsyncLLMEngine(engine)

    async def main():
        assert await _tokens(aengine, "before", [1]) == [2, 3, 4, 5, 6, 7]
        aengine.stop()
        with pytest.raises(EngineDeadError):
            await aengine.add_request("after", {"prompt_token_ids": [1]}, GREEDY)

    asyncio.run(main())
    assert not aengine.is_running


class _AlwaysFailing(CountingExecutor):
    def execute(self, step: StepInputs) -> torch.Tensor:
        raise RuntimeError("the device is gone")


def test_repeated_executor_failures_mark_the_loop_dead_and_fail_what_it_holds():
    engine, _ = make_engine()
    engine.executor = _AlwaysFailing()
    loop = EngineLoop(engine)
    loop.start()
    got: dict[str, list] = {}
    try:
        for i in range(MAX_CONSECUTIVE_FAILED_STEPS + 2):
            got[f"r{i}"] = []
            try:
                loop.add(f"r{i}", loop.prepare({"prompt_token_ids": [i + 1]}, GREEDY), got[f"r{i}"].append)
            except EngineDeadError:
                break
        assert loop.stopped.wait(10), "the loop kept stepping a broken engine"
    finally:
        loop.stop()
    assert not loop.is_healthy and "in a row" in loop.dead_reason and not loop.is_running
    answers = [items for items in got.values() if items]
    assert all(len(items) == 1 and isinstance(items[0], (RequestFailedError, EngineDeadError)) for items in answers)
    with pytest.raises(EngineDeadError):
        loop.submit("late", loop.prepare({"prompt_token_ids": [1]}, GREEDY), print).result(0)
    assert loop.stats().num_blocks_free == loop.stats().num_blocks_total


def test_an_engine_bug_stops_the_loop_instead_of_retrying_the_step():
    engine, _ = make_engine()
    calls = []

    def broken_schedule():
        calls.append(1)
        raise AssertionError("injected scheduler invariant failure")

    engine.scheduler.schedule = broken_schedule
    aengine = AsyncLLMEngine(engine)

    async def main():
        with pytest.raises(EngineDeadError, match="injected"):
            await asyncio.wait_for(_tokens(aengine, "r", [1]), 10)

    try:
        asyncio.run(main())
    finally:
        aengine.stop()
    assert len(calls) == 1, "the failing step was retried"
    assert aengine.dead_reason is not None and not aengine.is_running


def test_a_broken_engine_turns_health_to_503_and_stops_the_server():
    """What `trtopt serve` runs (server.run_server): the engine breaks, /health says so, the server exits with the
    reason (the CLI then exits 1 for a supervisor to restart it)."""
    import httpx
    import uvicorn

    from live_server import free_port, wait_healthy
    from trtopt.serving.server import create_app, run_server

    engine, executor = make_engine()
    aengine = AsyncLLMEngine(engine)
    app = create_app(aengine, "m")
    port = free_port()
    result: list = []
    runner = threading.Thread(target=lambda: result.append(
        run_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"), aengine)))
    runner.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 30)
    body = {"model": "m", "prompt": [POISON], "max_tokens": 2}
    health = None
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS):
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=10).status_code == 500
    try:
        health = httpx.get(f"{base}/health", timeout=2)
    except httpx.TransportError:
        pass  # already gone: the server exits right after the engine broke
    runner.join(20)
    assert not runner.is_alive(), "the server kept running on a broken engine"
    assert result and "in a row" in result[0]
    if health is not None:
        assert health.status_code == 503 and "in a row" in health.text
