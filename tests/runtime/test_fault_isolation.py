"""One request's fault never reaches another (issue 10): sampling, update and input faults end only their own
request with finish_reason="error"; an executor failure ends only its step's requests and is never re-raised;
aborting an n>1 request before its siblings fork works; a huge n is refused before any per-sibling work.

Runs on the paged echo model (tests/runtime/echo_model.py), whose output depends on everything its block tables
read back, so "the others still equal the reference" also checks that nothing of theirs was disturbed.
"""

from __future__ import annotations

import pytest

from trtopt.errors import RequestError
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams

from echo_model import EchoExecutor, ExplodingDetokenizer, check_engine, make_plan, poison, reference_generate

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_engine(*, num_blocks=64, max_num_tokens=64, max_num_seqs=8, **cfg):
    ex = EchoExecutor(4)
    plan = make_plan(block_size=4, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_model_len=64)
    return LLMEngine(ex, plan, None, EngineConfig(num_blocks=num_blocks, **cfg)), ex


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, object]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_engine(engine)
    raise AssertionError("the engine made no progress")


def refuse_inputs_of(engine: LLMEngine, request_id: str) -> None:
    """Make the engine's input builder raise for any batch that holds request_id (an injected input fault)."""
    build = engine.input_builder.build

    def build_refusing(batch):
        assert all(s.request_id != request_id for s in batch.seqs), "injected input-builder fault"
        return build(batch)

    engine.input_builder.build = build_refusing


# ---- finding 1: a request's own fault ends that request only ----------------------------------------------------


def test_a_sampling_fault_ends_only_its_request_and_the_others_are_undisturbed():
    engine, _ = make_engine()
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("alone", [9, 8, 7], seeded)
    alone = run_all(engine)["alone"].outputs[0].token_ids

    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("poison", [5, 6, 8], SamplingParams(temperature=1.0, max_tokens=8))
    poison(engine, "poison", top_k=2**63)
    engine.add_request("seeded", [9, 8, 7], seeded)
    engine.add_request("b", [11, 12, 13, 14, 15], GREEDY)
    done = run_all(engine)
    assert done["poison"].outputs[0].finish_reason == "error" and "sampling" in done["poison"].error
    assert done["a"].outputs[0].token_ids == reference_generate([5, 6, 7], 8, eos=None)
    assert done["b"].outputs[0].token_ids == reference_generate([11, 12, 13, 14, 15], 8, eos=None)
    # The faulty step re-sampled its good rows alone, with the uniforms already drawn: a seeded request's tokens
    # are the ones it gets with no faulty neighbour.
    assert done["seeded"].outputs[0].token_ids == alone
    assert all(done[r].error is None for r in ("a", "b", "seeded"))


def test_a_huge_logprobs_fails_its_request_not_the_batch():
    engine, _ = make_engine()
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))
    engine.add_request("greedy-lp", [3, 4], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    poison(engine, "greedy-lp", logprobs=10**6)
    done = run_all(engine)
    assert done["greedy-lp"].outputs[0].finish_reason == "error"
    assert done["a"].outputs[0].token_ids == reference_generate([5, 6, 7], 4, eos=None)


def test_an_update_fault_ends_only_its_request():
    engine, _ = make_engine()
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("bad", [5, 6, 8], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    engine.output_processor.groups["bad"].seqs[0].detok = ExplodingDetokenizer()
    done = run_all(engine)
    bad = done["bad"]
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"], "every completion of the request ends"
    assert "UnicodeDecodeError" in bad.error
    assert done["a"].outputs[0].token_ids == reference_generate([5, 6, 7], 8, eos=None)


def test_an_input_fault_ends_only_its_request():
    engine, ex = make_engine()
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("bad", [5, 6, 8], GREEDY)
    refuse_inputs_of(engine, "bad")
    done = run_all(engine)
    assert done["bad"].outputs[0].finish_reason == "error" and "preparing the inputs" in done["bad"].error
    assert done["a"].outputs[0].token_ids == reference_generate([5, 6, 7], 8, eos=None)


def test_an_executor_failure_is_reported_never_raised_and_counted():
    engine, ex = make_engine()
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [5, 6, 8], GREEDY)
    engine.step()
    for i in range(1, 3):
        ex.fail_next = True
        outs = engine.step()  # nothing was retried: the failed step's requests are gone
        assert engine.num_consecutive_failed_steps == i
        if i == 1:
            assert {o.request_id for o in outs} == {"a", "b"}
            assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
        engine.add_request(f"next{i}", [7, 7, 7], GREEDY)
        check_engine(engine)
    assert run_all(engine)["next2"].outputs[0].token_ids == reference_generate([7, 7, 7], 8, eos=None)
    assert engine.num_consecutive_failed_steps == 0


# ---- finding 3: n>1 aborts and failures before the siblings fork -------------------------------------------------


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])  # before admission, mid chunked prefill, after the fork
def test_aborting_an_n2_request_at_any_moment_leaves_nothing_behind(steps_before_abort):
    engine, _ = make_engine(max_num_tokens=8)  # a 20-token prompt prefills in 3 chunks: the fork comes at step 3
    prompt = list(range(20, 40))
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompt, params)
    for _ in range(steps_before_abort):
        engine.step()
    assert engine.abort("r")
    check_engine(engine)
    assert not engine.scheduler.requests, "a sibling stayed behind"
    engine.add_request("r", prompt, params)  # the id is free again
    out = run_all(engine)["r"]
    assert [c.token_ids for c in out.outputs] == [reference_generate(prompt, 6, eos=None)] * 2


def test_an_executor_failure_during_an_n2_prefill_ends_the_whole_request():
    engine, ex = make_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("s", [8, 9], GREEDY)
    ex.fail_next = True
    outs = {o.request_id: o for o in engine.step()}
    assert [c.finish_reason for c in outs["r"].outputs] == ["error"] * 3 and "injected" in outs["r"].error
    check_engine(engine)
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [5, 6, 7], SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    assert [c.token_ids for c in run_all(engine)["r"].outputs] == [reference_generate([5, 6, 7], 4, eos=None)] * 3


# ---- finding 5: a huge n costs nothing --------------------------------------------------------------------------


class _CountingDict(dict):
    lookups = 0

    def __contains__(self, key) -> bool:
        _CountingDict.lookups += 1
        return super().__contains__(key)


def test_a_huge_n_is_refused_before_any_per_completion_work():
    engine, _ = make_engine()
    engine.scheduler.requests = _CountingDict()
    _CountingDict.lookups = 0
    with pytest.raises(RequestError, match="max_num_seqs"):
        engine.add_request("big", [5, 6], SamplingParams(n=10**7))
    assert _CountingDict.lookups < 10, "per-completion work ran before n was checked"
    check_engine(engine)


def test_an_input_fault_of_one_completion_ends_its_whole_request_and_the_step_runs_for_nobody_else():
    engine, ex = make_engine()
    engine.add_request("pair", [5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # prefill + fork: both completions now decode
    build = engine.input_builder.build
    engine.input_builder.build = lambda batch: (
        build(batch) if all(s.request_id != "pair#1" for s in batch.seqs) else 1 / 0)
    [out] = engine.step()
    assert [c.finish_reason for c in out.outputs] == ["error", "error"] and "ZeroDivisionError" in out.error
    assert engine.num_consecutive_failed_steps == 0, "one request's fault is not an executor failure"
    check_engine(engine)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_request_whose_prompt_blocks_another_hit_in_the_same_step_does_not_hurt_it(async_scheduling):
    """Found by the engine fuzz (CI, session 8): blocks enter the prefix cache when scheduled, so a request admitted
    in the same step as another with the same prefix shares the blocks the first one is about to compute. If the
    first one's inputs fail, those blocks are never written, and the second must not read them as if they were."""
    engine, ex = make_engine(async_scheduling=async_scheduling)
    prefix = [9, 8, 7, 6, 5, 4, 3, 2]  # two full blocks of 4
    engine.add_request("bad", prefix + [10], GREEDY)
    engine.add_request("good", prefix + [11, 12], GREEDY)
    # An n=2 request on the same prefix: its leader is sent back too, and both completions fork after its recompute.
    engine.add_request("pair", prefix + [13], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    refuse_inputs_of(engine, "bad")
    done = run_all(engine)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert done["good"].outputs[0].token_ids == reference_generate(prefix + [11, 12], 8, eos=None)
    assert done["good"].metrics.num_preemptions == 1, "it went back to the queue to compute the prefix itself"
    want = reference_generate(prefix + [13], 8, eos=None)
    assert [c.token_ids for c in done["pair"].outputs] == [want, want] and done["pair"].metrics.num_preemptions >= 1
