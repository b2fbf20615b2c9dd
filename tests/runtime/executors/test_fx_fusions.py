"""The torch executor's RoPE fusion: the matcher on real exported plans, and the Triton kernel's rounding.

Kernel tests run under the Triton interpreter without CUDA (tests/plugins/conftest.py sets it for kernels there; this
module sets it itself before importing the kernel) and on the GPU with the `gpu` marker.
"""

from __future__ import annotations

import operator
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, read_plan
from trtopt.plugins.rope.kernel import rope_triton
from trtopt.runtime.executors import onnx_ops, trtopt_ops
from trtopt.runtime.executors.fx_fusions import HALF_OF_DIM, gather_nonnegative, rope
from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch
from trtopt.runtime.executors.torch_executor import TorchExecutor
from trtopt.signature import NONNEGATIVE_INPUTS

from packed_steps import prefill_then_decode

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
        outs.append(prefill_then_decode(ex, plan.limits.block_size))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)


def _targets(ex: TorchExecutor) -> list[str]:
    return [getattr(n.target, "__name__", "") for n in ex.graph.module.graph.nodes]


def test_plans_carry_rope_and_the_fx_rewrite_finds_none(plan_dir):
    """With the plan-level pass (the default), the torch executor runs trtopt.Rope and has nothing left to rewrite;
    the Rope nodes then fold into PagedAttention's call (fuse_rope_into_paged_attention), unless that is turned off."""
    built = plan_dir("tiny-llama")
    ex = TorchExecutor(built, read_plan(built), fuse_rope_kv=False)
    assert ex.num_fused_rope == 0 and ex.num_fused_rope_kv == 0
    names = _targets(ex)
    assert names.count("rope") == 2 * ex.plan.model.num_layers and "neg" not in names  # trtopt_ops.rope


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_rope_folds_into_paged_attention_and_cpu_steps_are_unchanged(model, plan_dir):
    """Every layer's Rope(q), Rope(k) → PagedAttention becomes one paged_attention_rope call; on CPU that call runs
    the same ops as before, so a chunked prefill and a decode step give bit-identical logits."""
    built = plan_dir(model)
    plan = read_plan(built)
    outs = []
    for fuse in (True, False):
        ex = TorchExecutor(built, plan, fuse_rope_kv=fuse)
        names = _targets(ex)
        layers = plan.model.num_layers
        if fuse:
            assert ex.num_fused_rope_kv == layers
            assert names.count("paged_attention_rope") == layers and "rope" not in names
            assert "paged_attention" not in names
        else:
            assert names.count("paged_attention") == layers and names.count("rope") == 2 * layers
        outs.append(prefill_then_decode(ex, plan.limits.block_size, chunks=((12, 7), (8, 0))))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_paged_attention_rope_off_the_kernel_path_is_the_two_ropes_then_the_op():
    """On CPU, and on CUDA whenever the fused kernel's preconditions fail (here: cos in another dtype), the call is
    exactly Rope(q), Rope(k) and PagedAttention (the reference ops, poisoned pool and all)."""
    from trtopt.plugins.paged_attention.reference import paged_attention_ref

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 3, 16, generator=gen).to(DEVICE) for h in (4, 2, 2))
    _, cos, sin = rope_inputs(1, 1, 3, 16, torch.float32, seed=3)
    pool = torch.randn(4, 2, 2, 4, 16, generator=gen).to(DEVICE)
    meta = (torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), torch.tensor([4, 5, -1]))
    meta = tuple(m.to(DEVICE) for m in meta)
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    for c, s in ((cos, sin), (cos.double(), sin.double())):
        c, s = c.to(DEVICE), s.to(DEVICE)
        want_pool, got_pool = pool.clone(), pool.clone()
        want, _ = trtopt_ops.paged_attention(trtopt_ops.rope(q, c, s), trtopt_ops.rope(k, c, s), v, want_pool, *meta,
                                             **attrs)
        got, _ = trtopt_ops.paged_attention_rope(q, k, v, got_pool, *meta, rope_cos=c, rope_sin=s, rope_half=8,
                                                 **attrs)
        assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    if DEVICE.type == "cpu":  # and the CPU path is the reference's arithmetic
        ref_pool = pool.clone()
        ref, _ = paged_attention_ref(trtopt_ops.rope(q, cos, sin), trtopt_ops.rope(k, cos, sin), v, ref_pool, *meta,
                                     **attrs)
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_rope_folded_into_the_kv_write_is_bit_identical_on_gpu(model, plan_dir):
    """On CUDA the folded call runs the fused RoPE + KV-write kernel: the steps' logits equal the unfused executor's
    (Rope kernels, then the plain KV write) bit for bit."""
    built = plan_dir(model)
    plan = read_plan(built)
    outs = []
    for fuse in (True, False):
        ex = TorchExecutor(built, plan, device="cuda", fuse_rope_kv=fuse)
        assert ex.num_fused_rope_kv == (plan.model.num_layers if fuse else 0)
        outs.append(prefill_then_decode(ex, plan.limits.block_size))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


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


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_gathers_by_token_ids_positions_and_logits_rows_skip_the_negative_index_wrap(model, plan_dir):
    """The embedding (input_ids), the rotary tables (position_ids) and the logits rows (logits_indices) are read
    with one index_select each; the plan's logits are bit for bit those of the ONNX Gather's negative-index path."""
    built = plan_dir(model)
    plan = read_plan(built)
    ex = TorchExecutor(built, plan)
    names = _targets(ex)
    # embedding + logits rows, + cos and sin tables on plans built with rope_table (the default)
    assert ex.num_nonnegative_gathers == names.count("gather_nonnegative") >= 4
    assert "gather" not in names
    slow = TorchExecutor(built, plan)
    for node in slow.graph.module.graph.nodes:
        if node.target is onnx_ops.gather_nonnegative:
            node.target = onnx_ops.gather
    slow.graph.module.recompile()
    for a, b in zip(prefill_then_decode(ex, plan.limits.block_size), prefill_then_decode(slow, plan.limits.block_size)):
        assert torch.equal(a, b)


def test_a_gather_by_any_other_value_keeps_the_wrap():
    """Only signature inputs the runtime keeps non-negative qualify; a computed index (it may be negative in ONNX)
    or another input keeps onnx_ops.gather."""
    graph = torch.fx.Graph()
    table, ids, other = (graph.placeholder(n) for n in ("table", "input_ids", "other"))
    flat = graph.call_function(onnx_ops.reshape, (ids, [-1]))
    a = graph.call_function(onnx_ops.gather, (table, flat))
    b = graph.call_function(onnx_ops.gather, (table, other))
    c = graph.call_function(onnx_ops.gather, (table, graph.call_function(operator.neg, (ids,))))
    graph.output((a, b, c))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert gather_nonnegative(gm, ["table", "input_ids", "other"], NONNEGATIVE_INPUTS) == 1
    assert [n.target for n in (a, b, c)] == [onnx_ops.gather_nonnegative, onnx_ops.gather, onnx_ops.gather]
    t = torch.arange(12.0).reshape(6, 2)
    got = gm(t, torch.tensor([[0, 5]]), torch.tensor([-1]))
    assert torch.equal(got[0], t[[0, 5]]) and torch.equal(got[1], t[[5]]) and torch.equal(got[2], t[[0, 1]][None])
