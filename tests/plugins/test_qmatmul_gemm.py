"""QMatMul's tensor-core path (plugins/qmatmul/gemm.py) and kernel.py's dispatch by rows, against the torch reference:
the Triton GEMM over the GEMV's packed weights (FP8, INT4/UINT4 with and without zero points, every group size it
takes), FP8 activations as codes with a row scale, and torch._scaled_mm's FP8 W8A8 call. Without CUDA the Triton
GEMM runs under the interpreter (tests/plugins/conftest.py) and _scaled_mm on the CPU; the `gpu` tests repeat the
cases at the 8B model's shapes on CUDA, where the dispatch takes _scaled_mm."""

from __future__ import annotations

import pytest
import torch

from test_qmatmul_kernel import _act_scale, _weight, _x
from trtopt.plugins.qmatmul import gemm
from trtopt.plugins.qmatmul.gemm import (DEQUANT_MM_MIN_ROWS, DynamicScale, GemmConfig, dequantize_weight,
                                         fake_quantize_fp8_rows, fp8_scaled_mm, gemm_config, gemm_supported,
                                         int4_block_k, qgemm, quantize_fp8_rows, scaled_mm_supported)
from trtopt.plugins.qmatmul.kernel import GEMV_MAX_ROWS, qmatmul_packed, qmatmul_triton
from trtopt.plugins.qmatmul.packing import dequantize_packed, pack_weight
from trtopt.plugins.qmatmul.reference import fake_quantize_fp8, qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC

# (kind, rows, K, N, group): the GEMV tests' shapes at GEMM row counts: odd N, odd K (FP8), every group size the
# GEMM takes (16..256: one K block a group, or two for 256), rows that leave partial row tiles.
CASES = [("fp8", 2, 97, 13, 0), ("fp8", 5, 200, 33, 0), ("fp8", 17, 64, 40, 0), ("fp8", 33, 300, 9, 0),
         ("int4", 2, 256, 33, 32), ("int4", 5, 96, 13, 32), ("int4", 17, 128, 5, 16), ("int4z", 33, 384, 11, 128),
         ("uint4", 2, 256, 21, 64), ("uint4z", 5, 512, 19, 128), ("uint4z", 17, 192, 9, 64),
         ("int4z", 5, 512, 7, 256), ("uint4", 33, 64, 3, 16)]


@pytest.mark.parametrize("kind,m,k,n,group", CASES)
def test_gemm_matches_the_reference(kind, m, k, n, group, kernel_device):
    gen = torch.Generator().manual_seed(m * k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen)
    x = _x(m, k, gen)
    args = [t.to(kernel_device) for t in (x, w, scale, zp, torch.tensor(1.0))]
    want = qmatmul_ref(*args, block_size=block)
    packed = pack_weight(*args[1:4], block_size=block)
    assert gemm_supported(packed)
    torch.testing.assert_close(qgemm(args[0].reshape(m, k), packed), want.reshape(m, n), atol=1e-4, rtol=1e-4)
    got = qmatmul_triton(*args, block_size=block)  # the dispatch: the GEMM past GEMV_MAX_ROWS rows, else the GEMV
    assert got.shape == (1, m, n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", [ACT_STATIC, ACT_DYNAMIC])
@pytest.mark.parametrize("kind,m,k,n", [("fp8", 2, 128, 24), ("fp8", 17, 96, 13), ("int4", 5, 128, 24)])
def test_gemm_with_quantized_activations(kind, m, k, n, act, kernel_device):
    """x's FP8 codes with the activation's scale as a row scale: the reference's Q/DQ(x) @ DQ(w)."""
    gen = torch.Generator().manual_seed(m + act)
    w, scale, zp, block = _weight(kind, k, n, 32, gen)
    x = _x(m, k, gen)
    args = [t.to(kernel_device) for t in (x, w, scale, zp, _act_scale(x, act))]
    attrs = dict(block_size=block, act_mode=act, act_block_size=k if act == ACT_DYNAMIC else 0)
    torch.testing.assert_close(qmatmul_triton(*args, **attrs), qmatmul_ref(*args, **attrs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,k,n,group", [("fp8", 97, 13, 0), ("fp8", 1030, 33, 0), ("int4", 256, 33, 32),
                                             ("int4z", 1024, 19, 128), ("uint4", 64, 5, 8), ("uint4z", 2048, 7, 1024),
                                             ("int4", 768, 17, 256)])
def test_dequantize_weight_is_the_reference_weight(kind, k, n, group, kernel_device):
    """The prefill path's dequantization: fp32 output equals dequantize_packed bit for bit (odd N, K past one block,
    groups from 8 to above the block); a 16-bit output is those values rounded once."""
    gen = torch.Generator().manual_seed(k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    want = dequantize_packed(packed).t()
    got = dequantize_weight(packed, torch.float32)
    assert got.shape == (n, k) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(dequantize_weight(packed, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("config", [GemmConfig(16, 16, 128, 4, 2), GemmConfig(32, 64, 64, 4, 3, group_m=1),
                                    GemmConfig(64, 32, 32, 4, 3, group_m=2),
                                    GemmConfig(16, 32, 32, 4, 2, fold_scale=True)])
@pytest.mark.parametrize("kind", ["fp8", "int4z"])
def test_other_gemm_configs(kind, config, kernel_device):
    """Tiles of every size the table uses (and K blocks below an INT4 group: two or four a group) compute the same
    product; rows over several row tiles, with the tutorial's band order."""
    gen = torch.Generator().manual_seed(11)
    w, scale, zp, block = _weight(kind, 256, 50, 128, gen)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    x = torch.randn(70, 256, generator=gen).to(kernel_device)
    torch.testing.assert_close(qgemm(x, packed, config=config), x @ dequantize_packed(packed), atol=1e-4, rtol=1e-4)


def test_gemm_config_table():
    assert int4_block_k(128) == 128 and int4_block_k(32) == 32 and int4_block_k(1024) == 128
    assert int4_block_k(2048) == 256 and int4_block_k(8) is None and int4_block_k(4096) is None
    for rows in (2, 16, 17, 64, 65, 256, 257, 2048):
        for group in (0, 16, 128, 256):
            cfg = gemm_config(rows, group, torch.bfloat16)
            assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16
            if group:
                assert group % cfg.block_k == 0 and cfg.block_k >= group // 8  # whole planes of one group
    assert gemm_config(2048, 0, torch.float32).num_stages == 2  # fp32's "ieee" dot: half the stages


def test_gemm_refusals():
    gen = torch.Generator().manual_seed(2)
    packed = pack_weight(*_weight("int4", 64, 8, 32, gen)[:3], block_size=32)
    with pytest.raises(ValueError, match="K contiguous"):
        qgemm(torch.zeros(4, 32), packed)
    with pytest.raises(ValueError, match="FP8 codes with a row scale"):
        qgemm(torch.zeros(4, 64).to(torch.float8_e4m3fn), packed)
    with pytest.raises(ValueError, match="must divide the group"):
        qgemm(torch.zeros(4, 64), packed, config=GemmConfig(16, 16, 64, 4, 2))
    small = pack_weight(*_weight("int4", 64, 8, 8, gen)[:3], block_size=8)
    assert not gemm_supported(small)
    with pytest.raises(ValueError, match="no K block"):
        qgemm(torch.zeros(4, 64), small)


def test_quantize_fp8_rows_gives_the_reference_codes():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 32, generator=gen) * 3
    for act in (ACT_STATIC, ACT_DYNAMIC):
        s = _act_scale(x, act)
        codes, row_scale = quantize_fp8_rows(x, s)
        assert codes.dtype == torch.float8_e4m3fn and row_scale.shape == (6, 1) and row_scale.is_contiguous()
        torch.testing.assert_close(codes.float() * row_scale, fake_quantize_fp8(x, s), atol=0, rtol=0)


def _every_fp8_boundary() -> torch.Tensor:
    """[1, n] fp32: every finite E4M3 value, every midpoint between neighbours (the ties) and a hair either side,
    ±0, values past the saturation bound, and a few far below the smallest subnormal."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = codes[codes.isfinite()].sort().values
    mids = (v[1:] + v[:-1]) / 2
    extra = torch.tensor([-0.0, 0.0, 448.5, 464.0, -1000.0, float("inf"), -float("inf"), 1e-12, -3e-3, 2.0 ** -10])
    return torch.cat([v, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), extra]).reshape(1, -1)


@pytest.mark.parametrize("slice_k", [None, 128])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.1])
def test_activation_quantize_kernel_is_onnx_quantize_linear_bit_for_bit(scale, slice_k, kernel_device):
    """`quantize_fp8_rows` / `fake_quantize_fp8_rows` (one Triton launch) give torch's codes and Q/DQ values exactly,
    sign of zero included, at every rounding boundary of E4M3 (ties to even) and past saturation, for a static
    scale and one per row; with the row in registers, and read in slices (slice_k: rows longer than a block)."""
    block = {"max_block": slice_k} if slice_k else {}
    x = _every_fp8_boundary() * scale
    x = torch.cat([x, -x]).to(kernel_device)  # two rows
    for s in (torch.tensor(scale), torch.tensor([[scale], [scale * 0.5]])):
        s = s.to(kernel_device)
        want = fake_quantize_fp8(x, s.reshape(-1, 1) if s.dim() else s)
        got = fake_quantize_fp8_rows(x, s, **block)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
        codes, row_scale = quantize_fp8_rows(x, s, **block)
        want_codes = (x / (s.reshape(-1, 1) if s.dim() else s)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(row_scale, s.float().reshape(-1, 1).expand(2, 1))


@pytest.mark.parametrize("act", [ACT_STATIC, ACT_DYNAMIC])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 96, 48), (33, 256, 16)])
def test_fp8_scaled_mm_matches_the_reference(m, k, n, act):
    """torch._scaled_mm's call (rowwise fp32 scales, bf16 out) on the packed weight, on the CPU's _scaled_mm (the
    GPU test repeats it on cuBLASLt): the reference rounded to bf16, up to one bf16 rounding step."""
    gen = torch.Generator().manual_seed(m + k)
    w, scale, zp, _ = _weight("fp8", k, n, 0, gen, dtype=torch.bfloat16)
    x = _x(m, k, gen, torch.bfloat16).reshape(m, k)
    s = _act_scale(x, act)
    codes, row_scale = quantize_fp8_rows(x, s)
    got = fp8_scaled_mm(codes, pack_weight(w, scale, zp, block_size=0), row_scale)
    want = qmatmul_ref(x, w, scale, zp, s, act_mode=act)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_few_row_w8a8_steps_take_the_fp8_triton_gemm():
    """The Triton FP8 GEMM's tile grows with the rows and narrows its columns when 64 would leave the grid small;
    the dispatch takes it for W8A8 steps of GEMV_MAX_ROWS + 1 to 16 rows (then _scaled_mm)."""
    assert gemm.SCALED_MM_MIN_ROWS == 17 and GEMV_MAX_ROWS < 3
    assert gemm.fp8_dot_config(16, 28672) == GemmConfig(16, 64, 128, 4, 4)  # 448 tiles of 64 columns: kept
    assert gemm.fp8_dot_config(16, 6144) == GemmConfig(16, 32, 128, 4, 4)  # 96 tiles of 64: 192 of 32
    assert gemm.fp8_dot_config(64, 2048) == GemmConfig(64, 32, 128, 4, 4)
    assert gemm.fp8_dot_config(512, 16384) == GemmConfig(128, 64, 128, 8, 4)  # 4 x 256 tiles


def test_scaled_mm_is_taken_only_where_it_runs():
    gen = torch.Generator().manual_seed(3)
    fp8 = pack_weight(*_weight("fp8", 64, 32, 0, gen)[:3], block_size=0)
    int4 = pack_weight(*_weight("int4", 64, 32, 32, gen)[:3], block_size=32)
    x = torch.zeros(80, 64, dtype=torch.bfloat16)
    assert not scaled_mm_supported(x, fp8)  # CPU tensors: the Triton GEMM (and the interpreter) instead
    assert not scaled_mm_supported(x, int4)
    assert fp8.scale.dtype == torch.float32  # what _scaled_mm's rowwise scale_b must be


# The 8B model's projections (K, N), on CUDA; FP8 through every path the dispatch has, INT4 g128 and UINT4 g32 + zp.
GPU_SHAPES = [(4096, 6144), (14336, 4096)]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU "
                         "machine)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind,group,act", [("fp8", 0, ACT_NONE), ("fp8", 0, ACT_STATIC), ("fp8", 0, ACT_DYNAMIC),
                                            ("int4", 128, ACT_NONE), ("uint4z", 32, ACT_NONE)])
@pytest.mark.parametrize("k,n", GPU_SHAPES)
@pytest.mark.parametrize("m", [2, 16, 64, 128, 300])
def test_dispatch_on_cuda_at_8b_shapes(kind, group, act, k, n, m):
    gen = torch.Generator().manual_seed(m + k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen, dtype=torch.bfloat16)
    x = _x(m, k, gen, torch.bfloat16).cuda()
    args = [x, *(t.cuda() for t in (w, scale, zp, _act_scale(x, act)))]
    attrs = dict(block_size=block, act_mode=act, act_block_size=k if act == ACT_DYNAMIC else 0)
    want = qmatmul_ref(*args, **attrs)  # fp32 math, rounded to bf16
    packed = pack_weight(*args[1:4], block_size=block)
    got = qmatmul_packed(x, packed, args[4], act_mode=act)
    if act == ACT_NONE and m >= DEQUANT_MM_MIN_ROWS:
        # the prefill path and the INT4 GEMM round each dequantized weight to bf16 (DequantizeLinear with the plan's
        # bf16 scale): close to the fp32 reference on the whole, and that product exactly up to summation order
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 2 ** -8, rel
        want = (x.float() @ dequantize_weight(packed, torch.bfloat16).float().t()).to(torch.bfloat16)
    # bf16 output: one rounding of an fp32 sum either way; different summation orders may straddle a bf16 step.
    # W8A8 through _scaled_mm: cuBLASLt's FP8 GEMM (its own accumulation order) saw 1 of 262,144 outputs 0.025 off
    # at 0.43 on an H200: allow one in ten thousand past the bound, none past 5x it (outputs reach ~50 here).
    err = (got.float() - want.float()).abs()
    bound = 2e-2 + 1e-2 * want.float().abs()
    past = err > bound
    assert float(past.float().mean()) <= (1e-4 if act != ACT_NONE else 0.0) and bool((err <= 5 * bound).all()), (
        f"{int(past.sum())} of {past.numel()} outputs off the reference, worst {float(err.max()):.3g}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind,group", [("fp8", 0), ("int4z", 128), ("uint4", 64)])
@pytest.mark.parametrize("m", [5, 64, 1000])
def test_gemm_in_fp32_on_cuda(kind, group, m):
    """fp32 x ("ieee" dot, fp32 out): the reference's fp32 result up to summation order."""
    gen = torch.Generator().manual_seed(m)
    w, scale, zp, block = _weight(kind, 4096, 1000, group, gen)
    packed = pack_weight(*(t.cuda() for t in (w, scale, zp)), block_size=block)
    x = torch.randn(m, 4096, generator=gen).cuda()
    torch.testing.assert_close(qgemm(x, packed), x @ dequantize_packed(packed), atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("act", [ACT_STATIC, ACT_DYNAMIC])
@pytest.mark.parametrize("m", [64, 2048])
def test_scaled_mm_and_triton_gemm_agree_on_cuda(act, m):
    """The two W8A8 paths (cuBLASLt FP8 and the Triton GEMM on the codes) give the same bf16 product, and the dispatch
    takes _scaled_mm on a Hopper GPU; captured in a CUDA graph, replayed with new x."""
    gen = torch.Generator().manual_seed(m + act)
    w, scale, zp, _ = _weight("fp8", 4096, 6144, 0, gen, dtype=torch.bfloat16)
    packed = pack_weight(*(t.cuda() for t in (w, scale, zp)), block_size=0)
    x = _x(m, 4096, gen, torch.bfloat16).cuda().reshape(m, 4096)
    s = _act_scale(x, act).cuda()
    codes, row_scale = quantize_fp8_rows(x, s)
    triton_y = qgemm(codes, packed, row_scale=row_scale.reshape(m), out_dtype=torch.bfloat16)
    torch.testing.assert_close(fp8_scaled_mm(codes, packed, row_scale).float(), triton_y.float(), atol=2e-2,
                               rtol=1e-2)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert scaled_mm_supported(x, packed)
    qmatmul_packed(x, packed, s, act_mode=act)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qmatmul_packed(x, packed, s, act_mode=act)
    x.copy_(torch.randn(m, 4096, generator=gen).to(torch.bfloat16).cuda())
    if act == ACT_DYNAMIC:
        s.copy_(_act_scale(x, act))
    graph.replay()
    want = qmatmul_ref(x, *(t.cuda() for t in (w, scale, zp)), s, act_mode=act)
    torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,slice_k", [(1, 96, None), (3, 1500, None), (3, 1500, 256), (17, 64, None)])
def test_dynamic_scale_in_the_quantize_launch_is_the_graphs(dtype, m, k, slice_k, kernel_device):
    """The per-token scale computed inside the quantize launch (DynamicScale) equals the quantizer's graph formula run
    by torch in the graph's dtype, bit for bit, and so do the codes; a row of zeros takes the minimum scale, and
    the dispatch gives the same product either way. slice_k: rows longer than the kernel's block (read twice)."""
    block = {"max_block": slice_k} if slice_k else {}
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).reshape(m, 1)).to(dtype)
    x[0, :] = 0.0 if m > 1 else x[0, :]
    x = x.to(kernel_device)
    dyn = DynamicScale(dtype, 2.0 ** -24)
    want_scale = dyn.reference(x)
    codes, row_scale = quantize_fp8_rows(x, None, dyn, **block)
    want_codes, want_rows = quantize_fp8_rows(x, want_scale)
    assert torch.equal(row_scale, want_scale.float())
    assert torch.equal(row_scale, want_rows)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(fake_quantize_fp8_rows(x, None, dyn, **block), fake_quantize_fp8_rows(x, want_scale))
    w, scale, zp, block = _weight("fp8", k, 24, 0, gen)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale.to(dtype), zp)), block_size=block)
    torch.testing.assert_close(qmatmul_packed(x, packed, None, act_mode=ACT_DYNAMIC, dynamic=dyn),
                               qmatmul_packed(x, packed, want_scale, act_mode=ACT_DYNAMIC), atol=0, rtol=0)


_COMPILE_GEMM_KERNELS = """
import triton.language as tl
from trtopt.plugins.qmatmul.gemm import _dequantize_weight, _quantize_fp8_rows
from trtopt.plugins.trt_common import compile_ptx
target = ("cuda", 90, 32)
sig = {"X": "*bf16", "S": "*bf16", "Q": "*u8", "RS": "*fp32", "K": "i32", "stride_xm": "i32", "stride_s": "i32",
       "stride_qm": "i32", "MIN_SCALE": "fp32"}
for dynamic in (True, False):
    k = compile_ptx(_quantize_fp8_rows, sig, dict(BLOCK_K=1024, DEQUANT=False, DYNAMIC=dynamic,
                    SCALE_DTYPE=tl.bfloat16), num_warps=4, num_stages=1, target=target)
    assert ".target sm_90" in k.ptx
    print("quantize", dynamic)
from trtopt.plugins.qmatmul.gemm import _qgemm
gsig = {"X": "*u8", "W": "*u8", "S": "*fp32", "Z": "*fp32", "XS": "*fp32", "Y": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
for bm, bn, warps in ((16, 64, 4), (64, 32, 4), (128, 64, 8)):  # fp8_dot_config's tiles
    k = compile_ptx(_qgemm, gsig, dict(INT4=False, GROUP=0, ZERO=0, X_FP8=True, ROW_SCALE=True, BLOCK_M=bm,
                    BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, FOLD_SCALE=False, DOT_DTYPE=tl.float8e4nv,
                    DOT_PRECISION="tf32", OUT_DTYPE=tl.bfloat16, FP8_DOT=True), num_warps=warps, num_stages=4,
                    target=target)
    # 64-row tiles and up: Hopper's FP8 warpgroup MMA on the codes; 16 rows: mma.sync on them widened (exact)
    assert bm < 64 or "wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3" % bn in k.ptx, bm
    print("fp8 dot", bm)
sig = {"W": "*i32", "S": "*bf16", "Z": "*u8", "OUT": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
       "stride_sn": "i32", "stride_on": "i32"}
for int4, zero in ((True, 8), (True, -1), (False, 0)):
    k = compile_ptx(_dequantize_weight, dict(sig, W="*i32" if int4 else "*u8"), dict(
        INT4=int4, GROUP=128 if int4 else 0, ZERO=zero, BLOCK_N=16, BLOCK_K=512, OUT_DTYPE=tl.bfloat16),
        num_warps=4, num_stages=1, target=target)
    assert ".target sm_90" in k.ptx
    print("dequantize", int4, zero)
"""


def test_new_gemm_kernels_compile_for_sm90():
    """The activation quantize launch (static and DYNAMIC), the W8A8 GEMM on FP8 tensor cores at its tiles and the
    prefill path's dequantization lower to sm_90 PTX
    on this CPU machine, in a fresh process (this one may be in interpreter mode)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_GEMM_KERNELS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") == 8, done.stdout
