"""The torch executor's RoPE fusion: the matcher on real exported plans, and the Triton kernel's rounding.

Kernel tests run under the Triton interpreter without CUDA (tests/plugins/conftest.py sets it for kernels there; this
module sets it itself before importing the kernel) and on the GPU with the `gpu` marker.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.build.builder import build_plan
from trtopt.build.plan import Limits, read_plan
from trtopt.check.driver import BlockSource, Seq, make_step
from trtopt.plugins.rope.kernel import rope_triton
from trtopt.runtime.executors import trtopt_ops
from trtopt.runtime.executors.fx_fusions import HALF_OF_DIM, rope
from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch
from trtopt.runtime.executors.torch_executor import TorchExecutor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unfused(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def rope_inputs(B, H, T, D, dtype, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=gen).transpose(1, 2)  # a transposed view, as the graph hands it over
    angles = torch.rand(T, D // 2, generator=gen) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1)[None, None]  # [1, 1, T, D]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[None, None]
    return x.to(device, dtype), cos.to(device, dtype), sin.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4, 7, 16), (2, 3, 5, 64), (1, 2, 1, 128)], ids=str)
def test_kernel_rounds_like_the_unfused_ops(shape, dtype):
    x, cos, sin = rope_inputs(*shape, dtype, seed=sum(shape))
    out = rope_triton(x, cos, sin)
    assert out.is_contiguous() and out.dtype == dtype
    exact = dict(atol=0, rtol=0)
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter converts fp32 -> bf16 by truncation, not round-to-nearest as the GPU and torch do (checked:
        # 1 + 2^-8 + 2^-10 becomes 1.0): up to one bf16 ulp of each product. The GPU test below is bit for bit.
        exact = dict(atol=2 * 2**-8 * float(x.abs().max()), rtol=2**-7)
    torch.testing.assert_close(out, unfused(x, cos, sin), **exact)


def test_kernel_refuses_what_it_cannot_do():
    x, cos, sin = rope_inputs(1, 2, 3, 16, torch.float32)
    with pytest.raises(ValueError, match="one float dtype"):
        rope_triton(x, cos.double(), sin)
    with pytest.raises(ValueError, match="even D"):
        rope_triton(x[..., :15], cos[..., :15], sin[..., :15])


def test_rope_falls_back_to_the_original_ops_off_the_fast_path():
    x, cos, sin = rope_inputs(1, 2, 3, 16, torch.float32, device="cpu")
    ref = unfused(x, cos, sin)
    assert torch.equal(rope(x, cos, sin, half=8, axis=3, hi_end=2**63 - 1, concat_axis=-1), ref)
    assert torch.equal(rope(x, cos, sin, half=HALF_OF_DIM, axis=3, hi_end=2**63 - 1, concat_axis=-1), ref)
    # mixed dtypes: torch's promotion, as the unfused graph would do
    got = rope(x.half(), cos, sin, half=8, axis=-1, hi_end=16, concat_axis=-1)
    assert got.dtype == torch.float32 and torch.equal(got, unfused(x.half(), cos, sin))


@pytest.mark.parametrize("model,exporter", [("tiny-llama", "dynamo"), ("tiny-qwen2", "dynamo"), ("tiny-llama", "legacy")])
def test_every_layer_fuses_and_the_step_is_bit_identical(model, exporter, export_dir, tmp_path):
    """Plans built without the plan-level rope pass (`--disable-pass rope`, as every plan was before it): the
    executor's fx rewrite still finds each layer's q and k rotation. Dynamo exports give `half` as a constant;
    TorchScript exports compute it from Shape(x) at run time."""
    built = build_plan(export_dir(model, exporter), tmp_path / "plan", progress=False,
                       limits=Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256),
                       disable_passes=("rope",)).plan_dir
    plan = read_plan(built)
    outs = []
    for fused in (True, False):
        ex = TorchExecutor(built, plan)
        if fused:
            assert ex.num_fused_rope == 2 * plan.model.num_layers  # q and k of every layer
            names = [getattr(n.target, "__name__", "") for n in ex.graph.module.graph.nodes]
            assert names.count("rope") == 2 * plan.model.num_layers and "neg" not in names
        else:
            ex.graph = onnx_to_torch(built / "model.onnx", device="cpu")  # the unfused conversion
        ex.allocate_kv_cache(16)
        source = BlockSource(16)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7)]
        first = ex.execute(make_step(seqs, [20, 7], plan.limits.block_size, source))
        for s in seqs:
            s.tokens.append(5)
        outs.append((first, ex.execute(make_step(seqs, [1, 1], plan.limits.block_size, source))))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)


def test_plans_carry_rope_and_the_fx_rewrite_finds_none(plan_dir):
    """With the plan-level pass (the default), the torch executor runs trtopt.Rope and has nothing left to rewrite."""
    built = plan_dir("tiny-llama")
    ex = TorchExecutor(built, read_plan(built))
    assert ex.num_fused_rope == 0
    names = [getattr(n.target, "__name__", "") for n in ex.graph.module.graph.nodes]
    assert names.count("rope") == 2 * ex.plan.model.num_layers and "neg" not in names  # trtopt_ops.rope


def test_plan_op_falls_back_to_the_exported_arithmetic():
    x, cos, sin = rope_inputs(1, 2, 3, 16, torch.float32, device="cpu")
    assert torch.equal(trtopt_ops.rope(x, cos, sin, half=8), unfused(x, cos, sin))
    assert torch.equal(trtopt_ops.rope(x, cos, sin, half=0), unfused(x, cos, sin))
    if DEVICE.type == "cuda":
        xc, cc, sc = (t.to(DEVICE) for t in (x, cos, sin))
        assert torch.equal(trtopt_ops.rope(xc, cc, sc, half=8), rope_triton(xc, cc, sc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 32, 1, 64), (1, 8, 300, 64), (1, 32, 4096, 128), (4, 14, 33, 80)], ids=str)
def test_kernel_is_bit_identical_on_gpu(shape, dtype):
    x, cos, sin = rope_inputs(*shape, dtype, seed=sum(shape))
    torch.testing.assert_close(rope_triton(x, cos, sin), unfused(x, cos, sin), atol=0, rtol=0)
