"""Sleep mode (vLLM's dev-mode POST /sleep, POST /wake_up, GET /is_sleeping; tests/entrypoints/serve/instrumentator/
test_sleep.py): the EngineLoop's levels and modes on a counting executor whose steps a test can hold open, then the
routes, their 4xx bodies and the engine_sleep_state gauge on a live app. In-process and model-free."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_engine_loop import VOCAB, CountingExecutor, make_engine
from trtopt.errors import RequestError
from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.engine_loop import EngineDeadError, EngineLoop, RequestAbortedError

NUM_BLOCKS = 32
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 40 steps: still running when sleep lands
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [20, 21, 22]  # the counting executor's reply counts on from 23 (mod 50), never reaching its poison 13


def _counted(n: int) -> list[int]:
    return [(PROMPT[-1] + 1 + i) % VOCAB for i in range(n)]


class _Collector:
    """An EngineLoop callback that keeps every output and the final one (or the error) of one request."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def __call__(self, item) -> None:
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        self.outputs.append(item)
        if item.finished:
            self.done.set()

    def tokens(self) -> list[int]:
        return self.outputs[-1].outputs[0].token_ids


@pytest.fixture
def loop_and_executor():
    engine, executor = make_engine(num_blocks=NUM_BLOCKS)
    allocations = [executor.num_blocks]  # the engine allocated its pools at construction
    inner = executor.allocate_kv_cache

    def record(num_blocks: int) -> None:
        allocations.append(num_blocks)
        inner(num_blocks)

    executor.allocate_kv_cache = record  # every (re)allocation of the pools, in order
    loop = EngineLoop(engine)
    loop.start()
    yield loop, executor, allocations
    executor.gate.set()
    loop.stop()


def _add(loop: EngineLoop, rid: str, prompt: list[int], params: SamplingParams = SHORT) -> _Collector:
    collector = _Collector()
    loop.add(rid, loop.prepare({"prompt_token_ids": prompt}, params), collector)
    return collector


def _sleep_mid_step(loop: EngineLoop, executor: CountingExecutor, level: int, mode: str) -> concurrent.futures.Future:
    """Hold the running request's step open, queue the sleep behind it, let the step finish: the sleep lands between
    this step and the next, with the request in flight."""
    executor.gate.clear()
    assert executor.in_step.wait(10), "the request never stepped"
    done = loop.sleep(level, mode)
    executor.gate.set()
    done.result(10)
    return done


def _free_all(loop: EngineLoop) -> bool:
    s = loop.stats()
    return s.num_blocks_free == s.num_blocks_total and s.num_running == 0 and s.num_waiting == 0


def test_level_1_abort_frees_every_block_and_the_pools_and_queues_new_work_until_wake_up(loop_and_executor):
    loop, executor, allocations = loop_and_executor
    running = _add(loop, "a", PROMPT, LONG)
    _sleep_mid_step(loop, executor, 1, "abort")
    assert running.done.wait(5) and isinstance(running.error, RequestAbortedError)
    assert loop.is_sleeping and loop.sleep_level == 1
    assert _free_all(loop)
    assert allocations == [NUM_BLOCKS, 2]  # the pools now hold the executors' minimum, two blocks
    steps = len(executor.step_sizes)
    queued = loop.submit("b", loop.prepare({"prompt_token_ids": [5, 6]}, SHORT), later := _Collector())
    time.sleep(0.3)
    assert not queued.done() and len(executor.step_sizes) == steps  # nothing runs while asleep
    loop.wake_up(["weights"]).result(5)
    assert loop.is_sleeping and allocations == [NUM_BLOCKS, 2]  # the KV cache still sleeps
    loop.wake_up(["kv_cache"]).result(5)
    assert not loop.is_sleeping and loop.sleep_level is None and allocations == [NUM_BLOCKS, 2, NUM_BLOCKS]
    queued.result(5)
    assert later.done.wait(5) and later.error is None and later.tokens() == [7, 8, 9, 10]
    time.sleep(0.05)
    assert _free_all(loop)


def test_wait_mode_lets_running_requests_finish_then_sleeps(loop_and_executor):
    loop, executor, allocations = loop_and_executor
    running = _add(loop, "a", PROMPT, LONG)
    executor.gate.clear()
    assert executor.in_step.wait(10)
    done = loop.sleep(1, "wait")
    executor.gate.set()
    deadline = time.monotonic() + 5
    while not loop.is_sleeping and time.monotonic() < deadline:  # the sleep lands after the held step
        time.sleep(0.001)
    executor.gate.clear()  # hold the next step: the request is still running
    assert loop.is_sleeping and not done.done() and not running.done.is_set()  # draining
    queued = loop.submit("b", loop.prepare({"prompt_token_ids": [5]}, SHORT), _Collector())
    executor.gate.set()
    done.result(10)
    assert running.done.is_set() and running.error is None and running.tokens() == _counted(40)
    assert not queued.done() and loop.sleep_level == 1 and allocations == [NUM_BLOCKS, 2] and _free_all(loop)
    loop.wake_up().result(5)
    queued.result(5)


def test_a_wake_up_cancels_a_wait_sleep_that_has_not_begun(loop_and_executor):
    loop, executor, allocations = loop_and_executor
    running = _add(loop, "a", PROMPT, LONG)
    executor.gate.clear()
    assert executor.in_step.wait(10)
    done = loop.sleep(1, "wait")
    woken = loop.wake_up()
    executor.gate.set()
    woken.result(10)
    with pytest.raises(RequestError, match="cancelled this sleep"):
        done.result(10)
    assert running.done.wait(10) and running.error is None and running.tokens() == _counted(40)
    assert not loop.is_sleeping and allocations == [NUM_BLOCKS]


def test_level_0_keep_freezes_requests_with_their_blocks_and_resumes_them(loop_and_executor):
    loop, executor, allocations = loop_and_executor
    running = _add(loop, "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    _sleep_mid_step(loop, executor, 0, "keep")
    steps = len(executor.step_sizes)
    time.sleep(0.3)
    assert len(executor.step_sizes) == steps and not running.done.is_set()
    assert loop.stats().num_blocks_free < loop.stats().num_blocks_total  # its blocks stay held
    assert allocations == [NUM_BLOCKS]  # level 0 releases nothing
    loop.wake_up(["scheduling"]).result(5)
    assert running.done.wait(10) and running.error is None and running.tokens() == _counted(10)


def test_a_kept_request_can_be_aborted_while_asleep_and_a_queued_one_lands_before_its_abort(loop_and_executor):
    loop, executor, _ = loop_and_executor
    kept = _add(loop, "a", PROMPT, LONG)
    _sleep_mid_step(loop, executor, 0, "keep")
    loop.abort("a")  # in the engine: applied while asleep, its blocks freed at once
    queued = loop.submit("b", loop.prepare({"prompt_token_ids": [5]}, LONG), _Collector())
    loop.abort("b")  # still queued: it must land after its add, at wake-up
    deadline = time.monotonic() + 5
    while not _free_all(loop) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _free_all(loop) and not kept.done.is_set()  # an aborted request's callback is not called again
    loop.wake_up().result(5)
    queued.result(5)
    deadline = time.monotonic() + 5
    while not _free_all(loop) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _free_all(loop)


@pytest.mark.parametrize("level, mode, message", [
    (2, "abort", "level 2"), (-1, "abort", "level -1"), (1, "later", "mode 'later'"), (1, "keep", '"keep"'),
])
def test_unsupported_sleeps_are_request_errors_that_change_nothing(loop_and_executor, level, mode, message):
    loop, _, allocations = loop_and_executor
    with pytest.raises(RequestError, match=message):
        loop.sleep(level, mode)
    assert not loop.is_sleeping and allocations == [NUM_BLOCKS]
    with pytest.raises(RequestError, match="unknown wake-up tag"):
        loop.wake_up(["gpu"])


def test_a_deeper_sleep_needs_a_wake_up_first_and_waking_an_awake_engine_is_a_no_op(loop_and_executor):
    loop, _, allocations = loop_and_executor
    loop.wake_up().result(5)  # awake already: nothing happens
    loop.sleep(0).result(5)
    loop.sleep(0).result(5)  # as deep already
    with pytest.raises(RequestError, match="already sleeps at level 0"):
        loop.sleep(1).result(5)
    loop.wake_up().result(5)
    assert not loop.is_sleeping and allocations == [NUM_BLOCKS]


def test_stop_while_asleep_answers_queued_work():
    engine, _ = make_engine(num_blocks=NUM_BLOCKS)
    loop = EngineLoop(engine)
    loop.start()
    loop.sleep(1).result(5)
    queued = loop.submit("a", loop.prepare({"prompt_token_ids": [1]}, SHORT), _Collector())
    assert loop.stop()
    with pytest.raises(EngineDeadError):
        queued.result(5)
    with pytest.raises(EngineDeadError):
        loop.wake_up().result(5)


def test_a_speculative_engine_refuses_level_1_but_pauses():
    engine, _ = make_engine(num_blocks=NUM_BLOCKS)
    # A stand-in SpecDecoder (what stats() reads of one): its draft's pools are not released.
    engine.spec = SimpleNamespace(stats=SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0,
                                                        accepted_per_position=[]))
    with pytest.raises(RequestError, match="speculative decoding"):
        engine.release_kv_cache()
    loop = EngineLoop(engine)
    loop.start()
    with pytest.raises(RequestError, match="speculative decoding"):
        loop.sleep(1)
    loop.sleep(0).result(5)
    assert loop.sleep_level == 0
    loop.stop()


# ---- the HTTP routes (vLLM's test_sleep.py, and the 4xx trtopt adds) ------------------------------------------------


def _app(engine, **options):
    from live_server import app_in_thread
    from trtopt.serving.server import ServerOptions

    return app_in_thread(engine, "m", options=ServerOptions(**options))


def _sleep_gauge(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.labels["sleep_state"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "vllm:engine_sleep_state" for s in family.samples}


@pytest.fixture(scope="module")
def sleepy_app():
    engine, executor = make_engine(num_blocks=NUM_BLOCKS)
    with _app(engine, server_dev_mode=True, enable_sleep_mode=True) as base:
        yield base, executor


def test_vllms_sleep_sequence(sleepy_app):
    base, _ = sleepy_app
    assert _sleep_gauge(base) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert httpx.post(f"{base}/sleep", params={"level": "1"}).status_code == 200
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": True}
    assert _sleep_gauge(base) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    assert httpx.post(f"{base}/wake_up").status_code == 200
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_gauge(base) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert httpx.post(f"{base}/sleep", params={"level": "1"}).status_code == 200
    assert httpx.post(f"{base}/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    assert httpx.post(f"{base}/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_gauge(base) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, params, param, message", [
    ("/sleep", {"level": "2"}, "level", "level 2 is not supported"),
    ("/sleep", {"level": "deep"}, "level", "not an integer"),
    ("/sleep", {"level": "1", "mode": "later"}, "level", "sleep mode 'later'"),
    ("/sleep", {"level": "1", "mode": "keep"}, "level", '"keep"'),
    ("/wake_up", {"tags": ["gpu"]}, "tags", "unknown wake-up tag"),
])
def test_bad_sleep_requests_are_openai_style_400s(sleepy_app, path, params, param, message):
    base, _ = sleepy_app
    resp = httpx.post(f"{base}{path}", params=params)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": False}


def test_a_request_in_flight_when_the_server_sleeps_gets_a_503(sleepy_app):
    base, executor = sleepy_app
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        executor.gate.clear()
        reply = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=30)
        assert executor.in_step.wait(10)
        slept = pool.submit(httpx.post, f"{base}/sleep", params={"level": "1"}, timeout=30)
        time.sleep(0.2)  # the sleep is queued behind the held step
        executor.gate.set()
        resp = reply.result(30)
        assert slept.result(30).status_code == 200
    assert resp.status_code == 503 and "put to sleep" in resp.json()["error"]["message"]
    assert httpx.post(f"{base}/wake_up").status_code == 200


def test_level_1_needs_enable_sleep_mode_and_the_routes_need_dev_mode():
    engine, _ = make_engine(num_blocks=NUM_BLOCKS)
    with _app(engine, server_dev_mode=True) as base:
        resp = httpx.post(f"{base}/sleep", params={"level": "1"})
        assert resp.status_code == 400 and "--enable-sleep-mode" in resp.json()["error"]["message"]
        assert httpx.post(f"{base}/sleep", params={"level": "0"}).status_code == 200  # a pause needs no flag
        assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(f"{base}/wake_up").status_code == 200
    engine, _ = make_engine(num_blocks=NUM_BLOCKS)
    with _app(engine) as base:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            resp = httpx.request(method, f"{base}{path}")
            assert resp.status_code == 404 and "error" in resp.json()
