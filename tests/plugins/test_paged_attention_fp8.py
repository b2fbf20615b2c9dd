"""PagedAttention with float8_e4m3fn pools (kv_cache_dtype="fp8"): the quantizing write and dequantizing read of
every CPU-runnable face (reference, CPU path, ONNX body on ORT, Triton kernels under the interpreter) against the
reference's to_pool / from_pool, and copy_blocks as a byte copy."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from test_paged_attention_reference import make_step
from trtopt.plugins import attach_functions, make_node
from trtopt.plugins.paged_attention.cpu import paged_attention_cpu
from trtopt.plugins.paged_attention.function import attach_fp8_kv_function, make_function
from trtopt.plugins.paged_attention.reference import (
    FP8_POOL_DTYPE, copy_blocks_ref, from_pool, paged_attention_ref, pool_values, quantized_pool, to_pool, write_kv,
)

F8 = FP8_POOL_DTYPE
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 8
SCALE = 0.25
INPUT_NAMES = ["q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"]
STEPS = [  # (context_lens, new_tokens, skipped slots): mixed, decode-only, one prefill
    ([23, 57, 1, 40, 35], [23, 19, 1, 1, 3], 2),
    ([9, 70, 33], [1, 1, 1], 0),
    ([45], [45], 0),
]
SCALES = [(1.0, 1.0), (0.5, 3.0)]  # vLLM's uncalibrated default, and scales that are not 1


def fp8_step(seed: int, context_lens, new_tokens, skip, *, k_scale: float, v_scale: float, magnitude: float = 1.0):
    """make_step with its pool quantized to float8 (old tokens as an earlier step's write stored them)."""
    step = make_step(random.Random(seed), context_lens=context_lens, new_tokens=new_tokens, num_heads=NUM_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, skip_slots=skip)
    for name in ("q", "k", "v"):
        step[name] = step[name] * magnitude
    pool = step["kv_cache"] * magnitude
    step["kv_cache"] = quantized_pool(pool, k_scale, v_scale)
    return step


def run_ref(step: dict, *, k_scale: float, v_scale: float, fn=paged_attention_ref):
    args = [step[name].clone() for name in INPUT_NAMES]
    return fn(*args, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=SCALE,
              k_scale=k_scale, v_scale=v_scale)


# ---------------------------------------------------------------------------------------------------------------
# The write's quantization and the read's dequantization.


def test_to_pool_saturates_rounds_to_nearest_even_and_keeps_negative_zero():
    x = torch.tensor([500.0, -1000.0, 448.0, -0.0, 0.0, 1.0625, 1.1875, -1.0625, 1e9, 0.3])
    got = to_pool(x, F8).float()
    assert got.tolist() == [448.0, -448.0, 448.0, 0.0, 0.0, 1.0, 1.25, -1.0, 448.0, 0.3125]
    assert torch.signbit(got[3]) and not torch.signbit(got[4])  # −0 stays −0
    # Saturation is on x / scale: with scale 4, 1000 saturates to 448 (read back as 1792), 1000 / 4 = 250 does not
    # (250 is not representable: the neighbours are 240 and 256, the nearest 256).
    assert from_pool(to_pool(torch.tensor([1000.0, 3000.0]), F8, 4.0), 4.0, torch.float32).tolist() == [1024.0, 1792.0]


def test_to_pool_and_from_pool_leave_other_pools_as_casts():
    x = torch.randn(5, 7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(to_pool(x, dtype, 3.0), x.to(dtype))
        assert torch.equal(from_pool(x.to(dtype), 3.0, torch.float32), x.to(dtype).float())


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_write_kv_round_trip(k_scale, v_scale):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, NUM_KV_HEADS, 5, HEAD_DIM, generator=gen) * 50
    v = torch.randn(1, NUM_KV_HEADS, 5, HEAD_DIM, generator=gen) * 50
    k[0, 0, 0, :4] = torch.tensor([1e4, -1e4, -0.0, 0.0])  # saturating and signed zeros
    pool = torch.zeros(4, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=F8)
    slots = torch.tensor([9, 10, -1, 24, 31])
    write_kv(k, v, pool, slots, k_scale=k_scale, v_scale=v_scale)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK_SIZE)
        stored_k, stored_v = pool[block, 0, :, offset], pool_values(pool)[block, :, offset]
        assert torch.equal(stored_k.view(torch.uint8), to_pool(k[0, :, t], F8, k_scale).view(torch.uint8))
        assert torch.equal(stored_v.view(torch.uint8), to_pool(v[0, :, t], F8, v_scale).view(torch.uint8))
        inside = k[0, :, t].abs() < 448 * k_scale
        back = from_pool(stored_k, k_scale, torch.float32)
        torch.testing.assert_close(back[inside], k[0, :, t][inside], rtol=2**-4, atol=2**-9 * k_scale)
    assert pool[1, 0, 0, 1, :2].float().tolist() == [448.0, -448.0]
    assert pool[1, 0, 0, 1, 2].view(torch.uint8).item() == 0x80  # −0
    assert not pool[2].view(torch.uint8).any()  # slot −1 wrote nothing


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("case", range(len(STEPS)))
def test_reference_attends_over_the_dequantized_pool(case, k_scale, v_scale):
    """The FP8 reference equals the fp32 reference over the values the FP8 pool holds (× scale), with the new keys
    and values quantized as the write stores them."""
    step = fp8_step(case, *STEPS[case], k_scale=k_scale, v_scale=v_scale)
    out, pool = run_ref(step, k_scale=k_scale, v_scale=v_scale)
    plain = dict(step)
    plain["kv_cache"] = torch.stack([from_pool(step["kv_cache"][:, 0], k_scale, torch.float32),
                                     from_pool(pool_values(step["kv_cache"]), v_scale, torch.float32)], dim=1)
    plain["k"] = from_pool(to_pool(step["k"], F8, k_scale), k_scale, torch.float32)
    plain["v"] = from_pool(to_pool(step["v"], F8, v_scale), v_scale, torch.float32)
    expected_out, expected_pool = run_ref(plain, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert pool.dtype == F8
    torch.testing.assert_close(from_pool(pool[:, 0], k_scale, torch.float32), expected_pool[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(from_pool(pool_values(pool), v_scale, torch.float32), expected_pool[:, 1], rtol=0,
                               atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("case", range(len(STEPS)))
def test_cpu_path_matches_the_reference(case, k_scale, v_scale, dtype):
    step = fp8_step(case, *STEPS[case], k_scale=k_scale, v_scale=v_scale)
    for name in ("q", "k", "v"):
        step[name] = step[name].to(dtype)
    out, pool = run_ref(step, k_scale=k_scale, v_scale=v_scale, fn=paged_attention_cpu)
    expected_out, expected_pool = run_ref(step, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(pool.view(torch.uint8), expected_pool.view(torch.uint8))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected_out.float(), rtol=tol, atol=tol)


def test_copy_blocks_is_a_byte_copy():
    gen = torch.Generator().manual_seed(1)
    pools = [to_pool(torch.randn(6, 2, 2, 4, 8, generator=gen) * 100, F8) for _ in range(3)]
    pools[0][2, 0, 0, 0, 0] = -0.0
    expected = [p.view(torch.uint8).clone() for p in pools]
    for e in expected:
        e[[4, 5]] = e[[2, 3]]
    copy_blocks_ref(pools, torch.tensor([[2, 4], [3, 5]]))
    for pool, e in zip(pools, expected):
        assert pool.dtype == F8 and torch.equal(pool.view(torch.uint8), e)


# ---------------------------------------------------------------------------------------------------------------
# The ONNX function body on ONNX Runtime (CPU): ScatterND and Gather take no float8 there, so the body widens the pool.


def fp8_model(opset: int, *, k_scale: float, v_scale: float) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    pool_dims = ["num_blocks", 2, NUM_KV_HEADS, "block_size", HEAD_DIM]
    inputs = [
        vi("q", TensorProto.FLOAT, [1, NUM_HEADS, "T", HEAD_DIM]),
        vi("k", TensorProto.FLOAT, [1, NUM_KV_HEADS, "T", HEAD_DIM]),
        vi("v", TensorProto.FLOAT, [1, NUM_KV_HEADS, "T", HEAD_DIM]),
        vi("kv_cache", TensorProto.FLOAT8E4M3FN, pool_dims),
        vi("block_tables", TensorProto.INT32, ["S", "max_blocks"]), vi("seq_lens", TensorProto.INT32, ["S"]),
        vi("query_start_loc", TensorProto.INT32, ["S_plus_1"]), vi("slot_mapping", TensorProto.INT64, ["T"]),
    ]
    node = make_node("PagedAttention", INPUT_NAMES, ["out", "kv_cache_out"], name="attn", num_heads=NUM_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=SCALE, kv_cache_dtype="fp8",
                     k_scale=k_scale, v_scale=v_scale)
    outputs = [vi("out", TensorProto.FLOAT, [1, NUM_HEADS, "T", HEAD_DIM]),
               vi("kv_cache_out", TensorProto.FLOAT8E4M3FN, pool_dims)]
    graph = helper.make_graph([node], "paged_attention_fp8", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return attach_fp8_kv_function(attach_functions(model))


def run_ort(model: onnx.ModelProto, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One run with the float8 pool bound by address (numpy, hence session.run, has no float8)."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for name in INPUT_NAMES:
        if name != "kv_cache":
            binding.bind_cpu_input(name, np.ascontiguousarray(step[name].numpy()))
    pool = step["kv_cache"].contiguous()
    pool_out = torch.empty_like(pool)
    binding.bind_input("kv_cache", "cpu", 0, TensorProto.FLOAT8E4M3FN, list(pool.shape), pool.data_ptr())
    binding.bind_output("out", "cpu")
    binding.bind_output("kv_cache_out", "cpu", 0, TensorProto.FLOAT8E4M3FN, list(pool.shape), pool_out.data_ptr())
    sess.run_with_iobinding(binding)
    return torch.from_numpy(binding.get_outputs()[0].numpy()), pool_out


@pytest.mark.parametrize("opset", [19, 21])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("case", range(len(STEPS)))
def test_function_body_on_ort_matches_the_reference(case, k_scale, v_scale, opset):
    model = fp8_model(opset, k_scale=k_scale, v_scale=v_scale)
    onnx.checker.check_model(model, full_check=True)
    # Large values too: the body's Cast must saturate as to_pool does.
    step = fp8_step(case, *STEPS[case], k_scale=k_scale, v_scale=v_scale, magnitude=150.0)
    out, pool = run_ort(model, step)
    expected_out, expected_pool = run_ref(step, k_scale=k_scale, v_scale=v_scale)
    # Block 0 is the null block: the body parks slot −1 writes there, the reference skips them. Nobody reads it.
    assert torch.equal(pool[1:].view(torch.uint8), expected_pool[1:].view(torch.uint8))
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-3)


def test_model_dtype_body_is_unchanged_and_lists_no_fp8_attributes():
    """Plans without FP8 pools keep the body (and node attributes) they had: the FP8 ones are omittable."""
    body = make_function(18)
    assert list(body.attribute)[:6] == ["num_heads", "num_kv_heads", "head_dim", "scale", "causal", "sliding_window"]
    assert not {"kv_cache_dtype", "k_scale", "v_scale"} & set(body.attribute)
    node = make_node("PagedAttention", INPUT_NAMES, ["out", "kv_cache_out"], num_heads=NUM_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=SCALE)
    assert not {"kv_cache_dtype", "k_scale", "v_scale"} & {a.name for a in node.attribute}
    fp8_body = make_function(19, kv_cache_dtype="fp8")
    assert {"kv_cache_dtype", "k_scale", "v_scale"} <= set(fp8_body.attribute)


# ---------------------------------------------------------------------------------------------------------------
# The Triton kernels (the CPU interpreter without CUDA: tests/plugins/conftest.py). The interpreter (Triton 3.x)
# converts fp32 to float8 wrongly whenever it must round (31.9 -> 16, 1.97 -> 1, ties not to even), while the GPU's
# conversion rounds to nearest even; values that are float8 already (and saturated ones, ±448) convert exactly. So
# under the interpreter the new K/V are chosen with x / scale on the float8 grid (the write's division, clamp and
# store are still exercised); on a GPU they are arbitrary.


def on_fp8_grid(x: torch.Tensor, scale: float, device: torch.device) -> torch.Tensor:
    """x itself on a GPU; under the interpreter the nearest value whose x / scale is a float8_e4m3fn."""
    return x if device.type == "cuda" else from_pool(to_pool(x, F8, scale), scale, torch.float32)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_triton_write_kv_quantizes_like_the_reference(kernel_device, k_scale, v_scale):
    from trtopt.plugins.paged_attention.kernel import write_kv_triton

    gen = torch.Generator().manual_seed(2)
    k = on_fp8_grid(torch.randn(1, NUM_KV_HEADS, 7, HEAD_DIM, generator=gen) * 200, k_scale, kernel_device)
    v = on_fp8_grid(torch.randn(1, NUM_KV_HEADS, 7, HEAD_DIM, generator=gen) * 200, v_scale, kernel_device)
    k[0, 1, 3, :3] = torch.tensor([-0.0, -1e6, 1e6])  # signed zero, saturation (token 3: slot 24)
    slots = torch.tensor([9, 10, -1, 24, 31, 8, 17])
    expected = torch.zeros(5, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=F8)
    write_kv(k, v, expected, slots, k_scale=k_scale, v_scale=v_scale)
    got = torch.zeros_like(expected, device=kernel_device)
    write_kv_triton(k.to(kernel_device), v.to(kernel_device), got, slots.to(kernel_device), k_scale=k_scale,
                    v_scale=v_scale)
    assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert got[3, 0, 1, 0, 0].view(torch.uint8).item() == 0x80
    assert got[3, 0, 1, 0, 1:3].float().tolist() == [-448.0, 448.0]


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("case", range(len(STEPS)))
def test_triton_attention_reads_fp8_like_the_reference(kernel_device, case, k_scale, v_scale):
    from trtopt.plugins.paged_attention.kernel import paged_attention_triton

    step = fp8_step(case, *STEPS[case], k_scale=k_scale, v_scale=v_scale)
    step["k"], step["v"] = on_fp8_grid(step["k"], k_scale, kernel_device), on_fp8_grid(step["v"], v_scale,
                                                                                       kernel_device)
    expected_out, expected_pool = run_ref(step, k_scale=k_scale, v_scale=v_scale)
    args = [step[name].clone().to(kernel_device) for name in INPUT_NAMES]
    out, pool = paged_attention_triton(*args, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                       scale=SCALE, k_scale=k_scale, v_scale=v_scale)
    assert pool is args[3] and pool.dtype == F8
    assert torch.equal(pool.cpu().view(torch.uint8), expected_pool.view(torch.uint8))
    torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size,tile_n,head_dim", [(32, 16, 16), (8, 32, 16), (16, 16, 16), (16, 32, 24)])
def test_triton_attention_reads_fp8_values_across_block_and_tile_sizes(kernel_device, block_size, tile_n, head_dim):
    """The value tile is read as runs of keys, one run per block in the tile (`_fp8_value_tile`): a tile inside
    one block (32/16), a tile of four blocks (8/32), one of each, and a head size padded in the kernel (24 → 32).
    Contexts end mid-block and mid-tile, with NaN in the slots past them, which no read may reach (a GPU run
    checks that: Triton's interpreter, 3.9, decodes 0x7F as 480, which a zero probability cancels)."""
    from trtopt.plugins.paged_attention.kernel import PagedLaunch, paged_attention_triton

    step = make_step(random.Random(7), context_lens=[75, 40, 9], new_tokens=[1, 3, 9], num_heads=NUM_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, block_size=block_size, skip_slots=0)
    step["kv_cache"] = quantized_pool(step["kv_cache"], 0.5, 3.0)
    # Every slot past a sequence's keys in its last block holds NaN (0x7F): a read there would poison the output.
    bytes_ = step["kv_cache"].view(torch.uint8)
    for row, length in zip(step["block_tables"].tolist(), step["seq_lens"].tolist()):
        last = row[(length - 1) // block_size]
        bytes_[last, 0, :, length % block_size or block_size:] = 0x7F
        pool_values(bytes_.view(F8))[last, :, length % block_size or block_size:] = float("nan")
    step["k"], step["v"] = on_fp8_grid(step["k"], 0.5, kernel_device), on_fp8_grid(step["v"], 3.0, kernel_device)
    args = [step[name].clone() for name in INPUT_NAMES]
    expected_out, expected_pool = paged_attention_ref(*args, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                                      head_dim=head_dim, scale=SCALE, k_scale=0.5, v_scale=3.0)
    assert expected_out.isfinite().all()
    args = [step[name].clone().to(kernel_device) for name in INPUT_NAMES]
    launch = PagedLaunch(block_q=2, tile_n=tile_n, num_segments=2, num_warps=4, num_stages=1)
    out, pool = paged_attention_triton(*args, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                                       scale=SCALE, k_scale=0.5, v_scale=3.0, launch=launch)
    assert torch.equal(pool.cpu().view(torch.uint8), expected_pool.view(torch.uint8))
    torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-4, atol=1e-4)


def test_triton_copy_blocks_on_fp8_pools(kernel_device):
    from trtopt.plugins.paged_attention.kernel import copy_blocks_triton

    gen = torch.Generator().manual_seed(3)
    pools = [to_pool(torch.randn(6, 2, 2, 4, 8, generator=gen) * 100, F8).to(kernel_device) for _ in range(2)]
    expected = [p.view(torch.uint8).cpu().clone() for p in pools]
    for e in expected:
        e[[4, 5]] = e[[1, 3]]
    copy_blocks_triton(pools, torch.tensor([[1, 4], [3, 5]]))
    for pool, e in zip(pools, expected):
        assert pool.dtype == F8 and torch.equal(pool.view(torch.uint8).cpu(), e)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_triton_rope_write_quantizes_like_rope_then_the_plain_write(kernel_device, k_scale, v_scale):
    """The RoPE-fused write of an FP8 pool stores the bytes that rope_triton(k) then write_kv_triton store, and
    returns rope_triton(q): what PagedAttention with rope_cos runs on an FP8 pool."""
    from trtopt.plugins.paged_attention.kernel import rope_write_kv_triton, write_kv_triton
    from trtopt.plugins.rope.kernel import rope_triton

    gen = torch.Generator().manual_seed(4)
    T = 7
    q, k, v = (torch.randn(1, h, T, HEAD_DIM, generator=gen).to(kernel_device) * 30
               for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    angles = torch.rand(T, HEAD_DIM // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(kernel_device)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(kernel_device)
    slots = torch.tensor([9, 10, -1, 24, 31, 8, 17], device=kernel_device)
    expected = torch.zeros(5, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=F8, device=kernel_device)
    write_kv_triton(rope_triton(k, cos, sin), v, expected, slots, k_scale=k_scale, v_scale=v_scale)
    got = torch.zeros_like(expected)
    q_out = rope_write_kv_triton(q, k, v, cos, sin, got, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())
    assert torch.equal(q_out.cpu(), rope_triton(q, cos, sin).cpu())


def test_fp8_pool_whose_value_plane_is_not_contiguous_is_refused():
    """The kernels address an FP8 pool's values as d·block_size + offset of a contiguous (block_size, D) plane; a
    pool laid out otherwise is refused with a ValueError before any launch, not read wrongly."""
    from trtopt.plugins.paged_attention.write_kv import fp8_constexprs

    pool = torch.zeros(3, 2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype=F8).transpose(-1, -2)  # D-major plane
    with pytest.raises(ValueError, match="must be contiguous"):
        fp8_constexprs(pool)
    assert fp8_constexprs(pool.contiguous()) == dict(FP8_KV=True)


FP8_POOL_KERNELS = [  # every Triton kernel that writes or reads an FP8 pool (TensorRT's AOT kernels aside)
    ("trtopt.plugins.paged_attention.attention", "_paged_attn_kernel"),
    ("trtopt.plugins.paged_attention.write_kv", "_write_kv_kernel"),
    ("trtopt.plugins.paged_attention.write_kv", "_rope_write_kv_kernel"),
    ("trtopt.runtime.kernels.gemv_triton", "_gemv_rope_kv"),
]


@pytest.mark.parametrize("module,name", FP8_POOL_KERNELS)
def test_fp8_scales_are_runtime_arguments_of_every_pool_kernel(module, name):
    """Calibrated scales differ per layer. As constexprs they compiled each kernel once per layer (Gemma-3's first
    pass with searched scales took 90-105 s on an H200, write_kv.py), so k_scale and v_scale are runtime
    arguments; only FP8_KV (the pool's dtype) specialises."""
    import importlib
    import inspect

    kernel = getattr(importlib.import_module(module), name)  # a JITFunction, or under the interpreter its wrapper
    params = inspect.signature(kernel.fn).parameters
    constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    assert {"k_scale", "v_scale"} <= params.keys() - constexpr and "FP8_KV" in constexpr
    assert not {n for n in params if n.upper() in ("K_SCALE", "V_SCALE")} - {"k_scale", "v_scale"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_layers_with_different_fp8_scales_share_one_compiled_kernel():
    """The same step launched with several layers' scales compiles the attention and KV-write kernels once: Triton's
    kernel cache for the device gains nothing after the first pair, and every result is still the reference's."""
    from trtopt.plugins.paged_attention.attention import _paged_attn_kernel
    from trtopt.plugins.paged_attention.kernel import paged_attention_triton
    from trtopt.plugins.paged_attention.write_kv import _write_kv_kernel

    def compiled() -> int:
        device = torch.cuda.current_device()
        return sum(len(k.device_caches[device][0]) for k in (_paged_attn_kernel, _write_kv_kernel))

    CUDA = torch.device("cuda")
    sizes = []
    for k_scale, v_scale in [(0.5, 3.0), (0.0129, 0.0131), (2.0, 0.25), (0.037, 1.5)]:
        step = fp8_step(0, *STEPS[0], k_scale=k_scale, v_scale=v_scale)
        step["k"], step["v"] = on_fp8_grid(step["k"], k_scale, CUDA), on_fp8_grid(step["v"], v_scale, CUDA)
        expected_out, expected_pool = run_ref(step, k_scale=k_scale, v_scale=v_scale)
        args = [step[name].clone().cuda() for name in INPUT_NAMES]
        out, pool = paged_attention_triton(*args, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                           head_dim=HEAD_DIM, scale=SCALE, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(pool.cpu().view(torch.uint8), expected_pool.view(torch.uint8))
        torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-4, atol=1e-4)
        sizes.append(compiled())
    assert sizes[1:] == sizes[:1] * 3, sizes
