"""Async scheduling (one step in flight, docs/architecture.md "The step loop") against the synchronous loop: the
same workload must give the same tokens, logprobs and finish reasons for every request, on the echo model (with a
pool tight enough to preempt, chunked prefill, prefix caching, n>1, seeded draws, penalties, min_tokens) and on a
real built plan through the torch executor, whose placeholders are filled by its own device-side path (here the
CPU; there logprobs agree to fp32 rounding only, as rows are batched differently). Unseeded random draws are left out: they share the engine's generator, so their tokens depend on the order
of draws, which the two loops need not share."""

from __future__ import annotations

import random

import pytest

from trtopt.runtime.config import EngineConfig, default_async_scheduling
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams

from echo_model import VOCAB, EchoExecutor, check_engine, make_plan, reference_generate


def _workload(seed: int, num: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(id, prompt, params, arrival step): greedy and seeded requests over shared prefixes, arriving over time."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randint(2, VOCAB - 1) for _ in range(rnd.randint(4, 12))] for _ in range(3)]
    out = []
    for i in range(num):
        prompt = (rnd.choice(prefixes) if rnd.random() < 0.6 else []) + [rnd.randint(2, VOCAB - 1) for _ in range(rnd.randint(1, 14))]
        greedy = rnd.random() < 0.5
        max_tokens = rnd.randint(1, 14)
        params = SamplingParams(
            n=rnd.choice([1, 1, 2, 3]), temperature=0.0 if greedy else 0.9, top_k=rnd.choice([0, 5]), seed=rnd.randint(0, 99),
            max_tokens=max_tokens, ignore_eos=rnd.random() < 0.3, logprobs=rnd.choice([None, None, 2]),
            min_tokens=min(max_tokens, rnd.choice([0, 0, 2])), repetition_penalty=rnd.choice([1.0, 1.0, 1.3]),
        )
        out.append((f"r{i}", prompt, params, rnd.randint(0, 12)))
    return out


def _run(engine: LLMEngine, workload) -> tuple[dict[str, list[tuple]], int]:
    """Drive the workload to the end; returns each request's completions and the number of steps."""
    done: dict[str, list[tuple]] = {}
    steps = 0
    pending = sorted(workload, key=lambda w: w[3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= steps:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs]
        check_engine(engine)
        steps += 1
        assert steps < 5000, "the workload never finished"
    return done, steps


class _ArgmaxEchoExecutor(EchoExecutor):
    """The echo model with the greedy argmax of each step's logits rows on hand (`last_greedy_tokens`), as a CUDA
    graph that takes the argmax leaves it: the engine must use it only where its rows are the sampled rows."""

    def execute(self, step):
        logits = super().execute(step)
        self.last_greedy_tokens = logits.argmax(-1)
        return logits


def _echo_engine(async_scheduling: bool, *, num_blocks: int, max_num_tokens: int, prefix_caching: bool,
                 argmax_on_hand: bool = False) -> LLMEngine:
    plan = make_plan(block_size=4, max_num_tokens=max_num_tokens, max_num_seqs=8, max_model_len=40)
    executor = _ArgmaxEchoExecutor(4) if argmax_on_hand else EchoExecutor(4)
    return LLMEngine(executor, plan, None, EngineConfig(
        num_blocks=num_blocks, enable_prefix_caching=prefix_caching, seed=0, async_scheduling=async_scheduling))


@pytest.mark.parametrize("seed, num_blocks, max_num_tokens, prefix_caching", [
    (0, 11, 8, True),  # room for one full-length sequence: preemption all the time, prompts chunked by 8
    (1, 20, 16, True),
    (2, 40, 64, False),
    (3, 14, 8, False),
])
def test_async_equals_sync_on_the_echo_model(seed, num_blocks, max_num_tokens, prefix_caching):
    workload = _workload(seed, 40)
    results = {}
    for mode, on_hand in ((False, False), (True, False), (True, True), (False, True)):
        engine = _echo_engine(mode, num_blocks=num_blocks, max_num_tokens=max_num_tokens, prefix_caching=prefix_caching,
                              argmax_on_hand=on_hand)
        assert engine.async_scheduling is mode
        results[mode, on_hand], _ = _run(engine, workload)
        if seed == 0:
            assert engine.scheduler.num_preemptions > 0, "the tight pool must preempt, or this proves less"
    assert results[True, False] == results[False, False] == results[True, True] == results[False, True]
    for rid, prompt, params, _ in workload:  # and both are right, not only equal
        if params.temperature == 0:
            want = reference_generate(prompt, params.max_tokens, eos=None if params.ignore_eos else 1)
            if params.min_tokens == 0 and params.repetition_penalty == 1:
                assert all(c[0] == want for c in results[True, False][rid]), rid


def test_greedy_tokens_on_hand_are_used_only_for_the_rows_they_belong_to():
    """Greedy rows that end while the next step is in flight leave dead rows in it, ahead of live ones: the
    executor's argmax rows are then not the sampled rows, and the engine must take its own argmax of the live ones."""
    engine = _echo_engine(True, num_blocks=40, max_num_tokens=64, prefix_caching=False, argmax_on_hand=True)
    prompts = {"a": [5, 6, 7], "b": [9, 3, 4, 8], "c": [2, 12, 13], "d": [40, 41]}
    ends = {"a": 2, "b": None, "c": 5, "d": None}  # a ends first, then c: dead rows ahead of and among live ones
    want = {}
    for rid, prompt in prompts.items():
        full = reference_generate(prompt, 12, eos=None)
        # A stop token the scheduler cannot see coming (max_tokens it can): the row after it is already in flight.
        stop = [full[ends[rid] - 1]] if ends[rid] else []
        want[rid] = full[: full.index(stop[0]) + 1] if stop else full
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=stop))
    done, _ = _run(engine, [])
    assert len(want["a"]) == 2 and len(want["c"]) <= 5
    for rid in prompts:
        assert done[rid][0][0] == want[rid], rid


def test_async_launches_the_next_step_before_reporting_the_last():
    engine = _echo_engine(True, num_blocks=20, max_num_tokens=64, prefix_caching=True)
    ex = engine.executor
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == [] and len(ex.steps) == 1  # the prefill ran; its token is still "on the device"
    first = engine.step()  # launched the first decode step, then reported the prefill's token
    assert len(ex.steps) == 2 and [o.outputs[0].token_ids for o in first] == [reference_generate([5, 6, 7], 1, eos=None)]
    assert ex.steps[1].input_ids.tolist() == [first[0].outputs[0].token_ids]  # the placeholder was filled in
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    # Its third token is its last (max_tokens): no step was launched for a token that would be discarded.
    assert len(ex.steps) == 3 and outs[-1].outputs[0].token_ids == reference_generate([5, 6, 7], 3, eos=None)
    check_engine(engine)


def test_a_sequence_that_stops_in_flight_has_its_next_row_discarded():
    prompt = [3, 5]
    ref = reference_generate(prompt, 30)
    assert ref[-1] == 1 and len(ref) < 30, "the prompt must reach EOS for this test"
    engine = _echo_engine(True, num_blocks=20, max_num_tokens=64, prefix_caching=True)
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=30))
    done, _ = _run(engine, [])
    assert done["eos"][0][:2] == (ref, "stop")
    # One prefill, one step per token after it, and one more whose row was discarded: EOS was not known in time.
    assert len(engine.executor.steps) == len(ref) + 1
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def test_abort_while_a_step_is_in_flight():
    engine = _echo_engine(True, num_blocks=20, max_num_tokens=64, prefix_caching=True)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("b", [5, 6, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("a")
    check_engine(engine)
    done, _ = _run(engine, [])
    assert "a" not in done and done["b"][0][0] == reference_generate([5, 6, 8], 8, eos=None)


def test_speculative_decoding_keeps_the_synchronous_loop():
    plan = make_plan(block_size=4, max_num_tokens=64, max_num_seqs=8, max_model_len=40)
    engine = LLMEngine(EchoExecutor(4), plan, None, EngineConfig(
        num_blocks=20, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    assert engine.async_scheduling is False


def test_default_is_on_for_cuda_only():
    assert default_async_scheduling("cuda") and default_async_scheduling("cuda:1")
    assert not default_async_scheduling("cpu")


# ---- a real plan through the torch executor (placeholders filled by the executor, CPU) ---------------------------

MODEL = "tiny-llama"


def _real_workload(stop: str) -> list[tuple[str, object, SamplingParams, int]]:
    shared = "The quick brown fox jumps over the lazy dog and then it runs far away into the forest, where"
    return [
        ("greedy", shared + " it", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 0),
        ("greedy2", shared + " they", SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), 0),
        ("seeded_n2", "Once upon a time there was a", SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True), 1),
        ("logprobs", "Hello, my name is", SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True), 2),
        ("penalty", "1 2 3 4 5", SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, min_tokens=4), 3),
        ("long", "word " * 60, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), 3),  # chunked prefill
        ("stop", "The capital of France", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), 4),
        ("short", shared, SamplingParams(temperature=0, max_tokens=1), 5),  # prefix-cache hit, one token
    ]


def test_async_equals_sync_on_a_real_plan(engine_for):
    free = engine_for(MODEL, "torch", max_model_len=128)
    free.add_request("free", "The capital of France", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = _run(free, [])[0]["free"]
    stop = free.tokenizer.decode(text[0][0])[10:16]  # a piece of real output: the stop string fires mid-run
    results = {}
    for mode in (False, True):
        # A small token budget chunks the long prompt; 14 blocks of 16 force preemptions under this load.
        engine = engine_for(MODEL, "torch", max_model_len=128, max_num_batched_tokens=32, num_blocks=14,
                            async_scheduling=mode)
        assert engine.async_scheduling is mode and engine.executor.resolves_placeholders
        results[mode], _ = _run(engine, _real_workload(stop))
        if mode:
            assert engine.scheduler.num_preemptions > 0
    # Tokens and finish reasons are equal; logprobs to fp32 rounding (the two loops batch rows differently).
    strip = lambda r: {rid: [c[:2] for c in cs] for rid, cs in r.items()}  # noqa: E731
    assert strip(results[True]) == strip(results[False])
    for (a, b) in zip(results[True]["logprobs"][0][2], results[False]["logprobs"][0][2]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert results[True]["stop"][0][1] == "stop"


@pytest.mark.gpu
def test_async_equals_sync_on_cuda_with_graphs(built_plan):
    """On the GPU the placeholders are filled on the device inside the graph-replay path and the tokens cross to the
    host behind the next launch: the same workload gives the same tokens as the synchronous loop, and steps replay
    graphs in both."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    plan_dir = built_plan(MODEL)
    free = LLMEngine.from_plan(plan_dir, device="cuda", max_model_len=128, async_scheduling=False)
    free.add_request("free", "The capital of France", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = free.tokenizer.decode(_run(free, [])[0]["free"][0][0])[10:16]

    results = {}
    for mode, in_graph in ((False, True), (True, True), (True, False)):  # and the argmax and fill outside the graph
        engine = LLMEngine.from_plan(plan_dir, device="cuda", max_model_len=128, max_num_batched_tokens=32,
                                     num_blocks=14, async_scheduling=mode, argmax_in_graph=in_graph)
        assert engine.async_scheduling is mode and engine.executor.graphs.argmax_in_graph is in_graph
        results[mode, in_graph], _ = _run(engine, _real_workload(stop))
        assert engine.executor.graphs.num_replayed > 0
    strip = lambda r: {rid: [c[:2] for c in cs] for rid, cs in r.items()}  # noqa: E731
    assert strip(results[True, True]) == strip(results[False, True]) == strip(results[True, False])


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_steps_take_argmax_and_placeholders_from_the_graphs(built_plan, monkeypatch, async_scheduling):
    """Plain greedy requests on CUDA: every step replays a graph that fills the placeholders and takes the argmax
    itself, so after start-up capture the engine launches neither from Python, and the tokens equal those of the
    argmax and fill launched from Python (argmax_in_graph off)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trtopt.runtime import sampler
    from trtopt.runtime.executors import cuda_graphs

    plan_dir = built_plan(MODEL)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
    calls = {"argmax": 0, "fill": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    tokens = {}
    for in_graph in (True, False):
        engine = LLMEngine.from_plan(plan_dir, device="cuda", max_model_len=128, async_scheduling=async_scheduling,
                                     argmax_in_graph=in_graph)
        monkeypatch.setattr(sampler, "greedy_argmax", counted("argmax", sampler.greedy_argmax))
        monkeypatch.setattr(cuda_graphs, "fill_placeholders_", counted("fill", cuda_graphs.fill_placeholders_))
        calls.update(argmax=0, fill=0)  # start-up capture ran both inside the graphs
        for i, p in enumerate(prompts):  # one length for all: no row ends while the next step is in flight
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        done, steps = _run(engine, [])
        tokens[in_graph] = {rid: outs[0][0] for rid, outs in done.items()}
        graphs = engine.executor.graphs
        assert graphs.num_eager == 0 and graphs.num_replayed >= 24
        if in_graph:
            assert calls == {"argmax": 0, "fill": 0}, calls
        else:
            assert calls["argmax"] >= 23 and (calls["fill"] >= 23 if async_scheduling else calls["fill"] == 0), calls
        monkeypatch.undo()
    assert tokens[True] == tokens[False] and all(len(t) == 24 for t in tokens[True].values())
