"""Scheduler and engine logic on the paged echo model (tests/runtime/echo_model.py).

The echo model's output depends on everything its block tables read back, so "output equals the
reference" checks slot mapping, prefix caching, copy-on-write and preemption end to end.
"""

import random

import pytest

from trtopt.errors import RequestError
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams

from echo_model import VOCAB, EchoExecutor, make_plan, prompts, reference_generate
from stepping import assert_idle, run_all


def make_engine(*, block_size=4, num_blocks=64, max_num_tokens=64, max_num_seqs=8, max_model_len=64, **cfg):
    plan = make_plan(block_size=block_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    ex = EchoExecutor(block_size)
    return LLMEngine(ex, plan, None, EngineConfig(num_blocks=num_blocks, **cfg)), ex


GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_all_at_once_matches_reference():
    engine, _ = make_engine()
    ps = prompts(6)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, GREEDY)
    done = run_all(engine)
    for i, p in enumerate(ps):
        assert done[str(i)].outputs[0].token_ids == reference_generate(p, 12)
    assert_idle(engine)


def test_finished_slot_is_refilled_on_the_very_next_step():
    engine, ex = make_engine(max_num_seqs=2)
    engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("long", [8, 9, 10], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request("third", [11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished_at = None
    step = 0
    while finished_at is None:
        outs = engine.step()
        step += 1
        if any(o.request_id == "short" and o.finished for o in outs):
            finished_at = step
    engine.step()
    # The step right after "short" finished already runs "third"'s prefill (4 tokens) beside "long".
    last = ex.steps[-1]
    assert last.num_seqs == 2 and last.num_tokens == 1 + 4
    run_all(engine)
    assert_idle(engine)


def test_chunked_prefill_never_exceeds_the_budget_and_decodes_keep_going():
    engine, ex = make_engine(max_num_tokens=16, max_model_len=128, num_blocks=128)
    engine.add_request("decoder", [3, 4, 5], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # prefill of "decoder"
    long_prompt = prompts(1, seed=3, lo=70, hi=70)[0]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = run_all(engine)
    assert all(s.num_tokens <= 16 for s in ex.steps)
    # While "long" prefilled in chunks of 15 (+ its last 10), "decoder" still got its token every step.
    assert [(s.num_seqs, s.num_tokens) for s in ex.steps[1:6]] == [(2, 16)] * 4 + [(2, 11)]
    assert done["long"].outputs[0].token_ids == reference_generate(long_prompt, 5, eos=None)
    assert done["decoder"].outputs[0].token_ids == reference_generate([3, 4, 5], 30, eos=None)
    assert_idle(engine)


def test_tiny_pool_forces_preemption_and_output_is_still_exact():
    # 12 usable blocks of 4 tokens; 6 requests growing to ~40 tokens cannot all fit.
    engine, _ = make_engine(num_blocks=13, max_model_len=44)
    ps = prompts(6, seed=1, lo=8, hi=16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    done = run_all(engine)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(ps):
        assert done[str(i)].outputs[0].token_ids == reference_generate(p, 24, eos=None)
    assert_idle(engine)


def test_no_request_starves_under_a_steady_stream():
    engine, _ = make_engine(num_blocks=17, max_num_seqs=3, max_model_len=32)
    rnd = random.Random(7)
    pending = [(f"r{i}", p) for i, p in enumerate(prompts(30, seed=7, lo=2, hi=10))]
    expected = {rid: reference_generate(p, 8) for rid, p in pending}
    done, steps = {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rnd.randint(0, 2)):  # arrivals keep coming while others run
            if pending:
                rid, p = pending.pop(0)
                engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=8))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < 2000
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == expected
    # First come, first served: requests got their first token in arrival order.
    order = sorted(done, key=lambda rid: done[rid].metrics.first_token_time)
    assert order == sorted(done, key=lambda rid: int(rid[1:]))
    assert_idle(engine)


def test_prefix_caching_skips_the_shared_prefix_and_output_is_exact():
    engine, ex = make_engine()
    system = list(range(40, 56))  # 4 full blocks
    ps = [system + [60 + i, 61 + i, 62] for i in range(4)]
    engine.add_request("first", ps[0], GREEDY)
    run_all(engine)
    for i, p in enumerate(ps[1:], 1):
        engine.add_request(str(i), p, GREEDY)
    done = run_all(engine)
    for i, p in enumerate(ps[1:], 1):
        assert done[str(i)].num_cached_tokens == 16
        assert done[str(i)].outputs[0].token_ids == reference_generate(p, 12)
    assert engine.stats().num_prefix_cache_hit_tokens >= 48
    assert_idle(engine)


def test_n2_forks_with_copy_on_write_and_seeds_equal_independent_runs():
    p = prompts(1, seed=5, lo=10, hi=10)[0]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    engine, ex = make_engine()
    engine.add_request("pair", p, params)
    pair = run_all(engine)["pair"]
    assert [c.index for c in pair.outputs] == [0, 1]
    assert ex.copies, "the sibling's write into the shared last block must copy it"
    # The prompt was prefilled once: 10 tokens, then 1 recomputed token for the sibling.
    assert ex.steps[0].num_tokens == 10 and ex.steps[1].num_seqs == 2
    assert_idle(engine)
    for i, seed in enumerate((123, 124)):
        solo, _ = make_engine()
        solo.add_request("solo", p, SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True))
        assert run_all(solo)["solo"].outputs[0].token_ids == pair.outputs[i].token_ids
    assert pair.outputs[0].token_ids != pair.outputs[1].token_ids


def test_seeded_output_does_not_depend_on_the_rest_of_the_batch():
    p = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone, _ = make_engine()
    alone.add_request("x", p, params)
    want = run_all(alone)["x"].outputs[0].token_ids
    busy, _ = make_engine()
    for i, q in enumerate(prompts(5, seed=9)):
        busy.add_request(f"other{i}", q, SamplingParams(temperature=1.0, max_tokens=15))
    busy.add_request("x", p, params)
    assert run_all(busy)["x"].outputs[0].token_ids == want


def test_stop_conditions():
    p = [20, 21, 22]
    ref = reference_generate(p, 20, eos=None)
    engine, _ = make_engine()
    engine.add_request("len", p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.add_request("stopid", p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[3]], ignore_eos=True))
    engine.add_request("min", p, SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[ref[3]], ignore_eos=True))
    done = run_all(engine)
    assert done["len"].outputs[0].token_ids == ref[:5] and done["len"].outputs[0].finish_reason == "length"
    stop = done["stopid"].outputs[0]
    assert stop.token_ids == ref[: ref.index(ref[3]) + 1] and stop.finish_reason == "stop" and stop.stop_reason == ref[3]
    # min_tokens masks the stop id in the sampler, so the sequence diverges from the reference at token 4.
    assert len(done["min"].outputs[0].token_ids) > 4
    assert ref[3] not in done["min"].outputs[0].token_ids[:6]
    assert_idle(engine)


def test_max_model_len_caps_generation():
    engine, _ = make_engine(max_model_len=16)
    # max_tokens=None runs to the context's end; a max_tokens past it is refused, never silently cut.
    with pytest.raises(RequestError, match="maximum context length is 16 tokens"):
        engine.add_request("x", list(range(2, 12)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.add_request("x", list(range(2, 12)), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_all(engine)["x"].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_abort_frees_every_block_at_once():
    engine, _ = make_engine()
    for i, p in enumerate(prompts(4, seed=2)):
        engine.add_request(str(i), p, SamplingParams(n=2 if i == 0 else 1, temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_blocks_used > 0
    for i in range(4):
        assert engine.abort(str(i))
    assert not engine.abort("0")
    assert not engine.has_unfinished_requests()
    assert_idle(engine)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        (list(range(2, 66)), GREEDY, "max_model_len"),
        ([], GREEDY, "empty"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ([5, VOCAB + 3], GREEDY, "outside the vocabulary"),
        ("text", GREEDY, "no tokenizer"),
        ([5, 6], SamplingParams(n=9), "max_num_seqs"),
    ],
)
def test_bad_requests_raise_and_leave_the_engine_healthy(prompt, params, match):
    engine, _ = make_engine()
    engine.add_request("ok", [5, 6, 7], GREEDY)
    engine.step()
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    done = run_all(engine)
    assert set(done) == {"ok"} and done["ok"].outputs[0].token_ids == reference_generate([5, 6, 7], 12)
    assert_idle(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
     ({"n": 0}, "n"), ({"min_p": 2}, "min_p"), ({"logprobs": -2}, "logprobs"), ({"stop": [""]}, "stop"),
     ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"temperature": float("nan")}, "temperature"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected():
    engine, _ = make_engine()
    engine.add_request("a", [5, 6], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", [7, 8], GREEDY)


def test_executor_failure_ends_the_batch_with_error_and_frees_blocks():
    engine, ex = make_engine()
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.step()
    ex.fail_next = True
    [out] = engine.step()  # reported as the request's end, never raised into a driver that would retry it
    assert out.finished and out.outputs[0].finish_reason == "error" and "injected" in out.error
    assert engine.num_consecutive_failed_steps == 1
    assert_idle(engine)
    engine.add_request("b", [5, 6, 7], GREEDY)
    assert run_all(engine)["b"].outputs[0].token_ids == reference_generate([5, 6, 7], 12)
    assert engine.num_consecutive_failed_steps == 0


def test_streamed_token_deltas_add_up():
    engine, _ = make_engine()
    engine.add_request("s", [4, 5, 6], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen += out.outputs[0].delta_token_ids
            assert out.outputs[0].token_ids == seen
    assert seen == reference_generate([4, 5, 6], 9, eos=None)
