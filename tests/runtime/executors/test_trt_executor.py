"""The TensorRT executor: profile logic without tensorrt; the engine path only where tensorrt and CUDA exist."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trtopt.build.plan import Limits, ModelFacts, PlanConfig
from trtopt.errors import ConfigError
from trtopt.runtime.executors.signature import STEP_INPUT_NAMES
from trtopt.plugins.trt_common import plugin_modules
from trtopt.runtime.executors.trt_executor import max_pool_blocks, profile_shapes

PLAN = PlanConfig(
    model=ModelFacts(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=1000, dtype="float16",
                     eos_token_ids=(2,)),
    limits=Limits(block_size=16, max_num_tokens=512, max_num_seqs=32, max_model_len=1000),
)


def test_profile_covers_every_input_of_the_paged_signature():
    shapes = profile_shapes(PLAN)
    assert set(shapes) == set(STEP_INPUT_NAMES) | {f"kv_cache.{i}" for i in range(3)}
    for name, shape in shapes.items():
        assert len(shape.min) == len(shape.opt) == len(shape.max), name
        assert all(lo <= opt <= hi for lo, opt, hi in zip(shape.min, shape.opt, shape.max)), name


def test_profile_bounds_come_from_limits():
    shapes = profile_shapes(PLAN)
    blocks_per_seq = 63  # ceil(1000 / 16)
    assert shapes["input_ids"].min == (1, 1) and shapes["input_ids"].max == (1, 512)
    assert shapes["slot_mapping"].max == (512,) and shapes["logits_indices"].max == (512,)
    assert shapes["block_tables"].max == (32, blocks_per_seq)
    assert shapes["seq_lens"].max == (32,)
    assert shapes["query_start_loc"].min == (2,) and shapes["query_start_loc"].max == (33,)
    assert max_pool_blocks(PLAN) == 32 * blocks_per_seq + 1
    assert shapes["kv_cache.2"].max == (32 * blocks_per_seq + 1, 2, 2, 16, 64)
    assert shapes["kv_cache.0"].min == (2, 2, 2, 16, 64)


def test_profile_opt_is_the_decode_regime_unless_told():
    shapes = profile_shapes(PLAN)
    assert shapes["input_ids"].opt == (1, 32) and shapes["seq_lens"].opt == (32,)
    prefill = profile_shapes(PLAN, opt_num_tokens=256, max_num_blocks=100)
    assert prefill["input_ids"].opt == (1, 256) and prefill["kv_cache.0"].max[0] == 100
    small = dataclasses.replace(PLAN, limits=Limits(block_size=16, max_num_tokens=8, max_num_seqs=32, max_model_len=64))
    assert profile_shapes(small)["input_ids"].opt == (1, 8) and profile_shapes(small)["seq_lens"].opt == (8,)
    with pytest.raises(ConfigError, match="max_num_blocks must be >= 2"):
        profile_shapes(PLAN, max_num_blocks=1)


def test_plugin_modules_name_each_trtopt_op_once(plan_dir):
    modules = plugin_modules(plan_dir("tiny-qwen2") / "model.onnx")
    # tiny-qwen2 has PagedAttention, RMSNorm and MatMulAdd: only PagedAttention has a TensorRT plugin
    assert modules == ["trtopt.plugins.paged_attention.trt_plugin"]
    assert all(m.startswith("trtopt.plugins.") and m.endswith(".trt_plugin") for m in modules)


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_engine_matches_torch_executor(plan_dir):
    pytest.importorskip("tensorrt", reason="tensorrt is only on NVIDIA's index; this path is written, not run here")
    if not torch.cuda.is_available():
        pytest.skip("the TensorRT engine needs a CUDA GPU")
    from paged_driver import BlockSource, Seq, make_step
    from trtopt.build.plan import read_plan
    from trtopt.runtime.executors import create_executor

    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    trt_ex = create_executor("tensorrt", built, plan, num_blocks=16)
    ref = create_executor("torch", built, plan, device="cuda", num_blocks=16)
    step = make_step([Seq(list(range(3, 24))), Seq([5, 6])], [21, 2], plan.limits.block_size, BlockSource(16))
    torch.testing.assert_close(trt_ex.execute(step), ref.execute(step), atol=1e-3, rtol=1e-3)
