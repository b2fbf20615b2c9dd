"""RequestOutputKind: FINAL_ONLY requests get one output, when they finish, equal to the last output the same request
gets with CUMULATIVE; the engine's other requests are not affected. LLM.generate uses FINAL_ONLY unless it is
given an on_output callback (which wants every step's output)."""

from __future__ import annotations

import dataclasses

import pytest

from trtopt.errors import RequestError
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import RequestOutputKind, SamplingParams

from echo_model import EchoExecutor, check_engine, make_plan, prompts
from test_async_scheduling import _workload


def _outputs_per_request(async_scheduling: bool, kind: RequestOutputKind | None):
    """Every output of the echo workload, by request id; `kind` overrides each request's output_kind."""
    plan = make_plan(block_size=4, max_num_tokens=16, max_num_seqs=8, max_model_len=40)
    engine = LLMEngine(EchoExecutor(4), plan, None, EngineConfig(num_blocks=24, seed=0, async_scheduling=async_scheduling))
    work = _workload(seed=3, num=14)
    seen: dict[str, list] = {rid: [] for rid, *_ in work}
    pending, steps = sorted(work, key=lambda w: w[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= steps:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind) if kind else params)
        for out in engine.step():
            seen[out.request_id].append(out)
        check_engine(engine)
        steps += 1
        assert steps < 5000
    return seen


def _final(out):
    return [(c.index, c.token_ids, c.finish_reason, c.logprobs, c.delta_token_ids) for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_gives_one_output_equal_to_the_last_cumulative_one(async_scheduling):
    cumulative = _outputs_per_request(async_scheduling, None)
    final = _outputs_per_request(async_scheduling, RequestOutputKind.FINAL_ONLY)
    assert any(len(outs) > 1 for outs in cumulative.values()), "the workload must stream several outputs per request"
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished, f"{rid}: {len(outs)} outputs"
        last = cumulative[rid][-1]
        assert last.finished
        got, want = _final(outs[0]), _final(last)
        # Same tokens, finish reasons and logprobs; the one final output's delta is everything generated.
        assert [g[:4] for g in got] == [w[:4] for w in want]
        assert [g[4] for g in got] == [w[1] for w in want]


def test_output_kind_is_validated_and_accepts_its_name():
    assert SamplingParams(output_kind="final_only").output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(RequestError, match="output_kind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(RequestError, match="output_kind"):
        SamplingParams(output_kind=2)


def test_final_only_params_stay_plain_greedy_and_hashable():
    p = SamplingParams(temperature=0.0, output_kind="final_only")
    assert p.plain_greedy and hash(p) == hash(SamplingParams(temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY))
    assert not SamplingParams(temperature=0.0, logprobs=1).plain_greedy


def test_a_final_only_request_that_fails_still_gets_its_error_output():
    """Failure outputs are made before the FINAL_ONLY filter: the failing request is told, the others finish."""
    from echo_model import poison

    plan = make_plan(block_size=4, max_num_tokens=16, max_num_seqs=8, max_model_len=40)
    engine = LLMEngine(EchoExecutor(4), plan, None, EngineConfig(num_blocks=24, seed=0))
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5, output_kind="final_only"))
    poison(engine, "r1", top_k=2**63, temperature=1.0)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        check_engine(engine)
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"] and all(o.finished for o in outs)
    by_id = {o.request_id: o for o in outs}
    assert by_id["r1"].error and by_id["r1"].outputs[0].finish_reason == "error"
    assert by_id["r0"].outputs[0].finish_reason == by_id["r2"].outputs[0].finish_reason == "length"
