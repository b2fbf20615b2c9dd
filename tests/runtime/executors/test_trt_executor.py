"""The TensorRT executor: plugin discovery without tensorrt; the engine path only where tensorrt and CUDA exist."""

from __future__ import annotations

import pytest
import torch

from trtopt.plugins.trt_common import plugin_modules


def test_plugin_modules_name_each_trtopt_op_once(plan_dir):
    modules = plugin_modules(plan_dir("tiny-qwen2") / "model.onnx")
    # tiny-qwen2 has PagedAttention, RMSNorm and MatMulAdd: only PagedAttention has a TensorRT plugin
    assert modules == ["trtopt.plugins.paged_attention.trt_plugin"]
    assert all(m.startswith("trtopt.plugins.") and m.endswith(".trt_plugin") for m in modules)


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_engine_matches_torch_executor(plan_dir):
    pytest.importorskip("tensorrt", reason="tensorrt is only on NVIDIA's index; this path is written, not run here")
    pytest.importorskip("polygraphy", reason="the engine build uses Polygraphy's loaders (the tensorrt extra)")
    if not torch.cuda.is_available():
        pytest.skip("the TensorRT engine needs a CUDA GPU")
    from trtopt.check.driver import BlockSource, Seq, make_step
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import create_executor

    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    trt_ex = create_executor("tensorrt", built, plan, num_blocks=16)
    ref = create_executor("torch", built, plan, device="cuda", num_blocks=16)
    step = make_step([Seq(list(range(3, 24))), Seq([5, 6])], [21, 2], plan.limits.block_size, BlockSource(16))
    torch.testing.assert_close(trt_ex.execute(step), ref.execute(step), atol=1e-3, rtol=1e-3)
