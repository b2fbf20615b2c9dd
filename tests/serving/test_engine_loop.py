"""EngineLoop / AsyncLLMEngine on a tiny counting executor (no model): batching across callers, abort on early
exit, failure isolation, and no leaked KV blocks. Fast and in-process."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from trtopt.build.plan import Limits, ModelFacts, PlanConfig
from trtopt.errors import RequestError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.engine import EngineConfig, LLMEngine
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.async_engine import AsyncLLMEngine
from trtopt.serving.engine_loop import EngineLoop

VOCAB = 50
POISON = 13  # a step that contains this token id fails, as a broken kernel would


class CountingExecutor:
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
        loop.add("a", {"prompt_token_ids": [1]}, GREEDY, explode)
        loop.add("b", {"prompt_token_ids": [2]}, GREEDY, collect)
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
