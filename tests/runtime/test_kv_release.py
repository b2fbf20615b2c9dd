"""LLMEngine.release_kv_cache / restore_kv_cache (the server's sleep level 1) on a real built plan and executor:
the pools shrink to the executors' minimum, and after the restore the engine generates what it did before."""

import pytest

from trtopt.runtime import LLM, SamplingParams


@pytest.mark.parametrize("model", ["tiny-llama"])
def test_released_pools_come_back_and_generate_the_same(built_plan, model):
    llm = LLM(built_plan(model), max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(["Hello there", "The capital of France is"], params)
    engine = llm.engine
    num_blocks = engine.executor.num_blocks
    engine.release_kv_cache()
    assert engine.kv_cache_released and engine.executor.num_blocks == 2 < num_blocks
    engine.restore_kv_cache()
    assert not engine.kv_cache_released and engine.executor.num_blocks == num_blocks
    after = llm.generate(["Hello there", "The capital of France is"], params)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
