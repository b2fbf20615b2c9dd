"""Driving an LLMEngine in tests: step it until every request has finished, then check that it is idle."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trtopt.runtime.batch import RequestOutput
    from trtopt.runtime.engine import LLMEngine


def run_all(engine: LLMEngine, max_steps: int = 20_000) -> dict[str, RequestOutput]:
    """Step until no request is left; return the final output of each request by id. An engine that is still busy
    after max_steps steps is stuck (a test's requests need far fewer), so the test fails rather than hangs."""
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return done


def assert_idle(engine: LLMEngine) -> None:
    """No request runs or waits, every usable block is back in the free list, and the pool's invariants hold."""
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0
    assert st.num_blocks_free == st.num_blocks_total, "blocks leaked"
    engine.pool.check_invariants()
