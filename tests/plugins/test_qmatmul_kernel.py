"""The QMatMul decode GEMVs (plugins/qmatmul/kernel.py) and their packed weight layout (packing.py) vs the torch
reference, at odd shapes, every group size, 1..MAX_ROWS rows, FP8 and INT4/UINT4 weights and every activation mode.
Without CUDA the kernels run under the Triton interpreter (tests/plugins/conftest.py); the `gpu` tests repeat the
cases at a decode step's real shapes on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trtopt.plugins.qmatmul.gemm import qgemm
from trtopt.plugins.qmatmul.kernel import (
    GEMV_MAX_ROWS, MAX_ROWS, XP_GEMV_MAX_ROWS, default_config, gemv_max_rows, qgemv, qmatmul_packed, qmatmul_triton,
)
from trtopt.plugins.qmatmul.kernel_half2 import default_config_half2, default_config_xp
from trtopt.plugins.qmatmul.packing import dequantize_packed, pack_weight, packable
from trtopt.plugins.qmatmul.reference import dequantize_weight, qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC


def _weight(kind: str, k: int, n: int, group: int, gen: torch.Generator, dtype: torch.dtype = torch.float32):
    """(w_q, scale, zero point, block_size) as the torch executor loads a QMatMul's weight. kind: fp8, int4 (symmetric,
    zero points 0), int4z (signed zero points), uint4 (no zero points) or uint4z."""
    if kind == "fp8":
        w = (torch.randn(k, n, generator=gen) * 50).to(torch.float8_e4m3fn)
        scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
        return w, scale.to(dtype), torch.full((n,), -0.0).to(torch.float8_e4m3fn), 0  # -0 is a zero point of 0
    lo, hi, wdtype = (-8, 8, torch.int8) if kind.startswith("int4") else (0, 16, torch.uint8)
    w = torch.randint(lo, hi, (k, n), generator=gen).to(wdtype)
    scale = torch.rand(k // group, n, generator=gen) * 0.1 - 0.05  # signed, as ORT's symmetric quantizer writes
    zp = torch.randint(lo, hi, (k // group, n), generator=gen) if kind.endswith("z") else torch.zeros(k // group, n)
    return w, scale.to(dtype), zp.to(wdtype), group


def _x(m: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(1, m, k, generator=gen).to(dtype)


def _act_scale(x: torch.Tensor, act: int) -> torch.Tensor:
    if act == ACT_DYNAMIC:
        return (x.float().abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
    return torch.tensor(0.02)


@pytest.mark.parametrize("kind", ["fp8", "int4", "int4z", "uint4", "uint4z"])
@pytest.mark.parametrize("k,n,group", [(64, 24, 8), (96, 13, 32), (256, 7, 64), (384, 5, 128), (128, 3, 16)])
def test_packing_keeps_the_dequantized_weight(kind, k, n, group):
    gen = torch.Generator().manual_seed(k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen)
    assert packable(w, scale, block_size=block)
    packed = pack_weight(w, scale, zp, block_size=block)
    assert torch.equal(dequantize_packed(packed), dequantize_weight(w, scale, zp, block_size=block))
    if kind != "fp8":
        assert packed.data.dtype == torch.int32 and packed.data.shape == (n, k // 8)  # 4 bits a value
        assert (packed.zero is None) == (not kind.endswith("z"))
        assert packed.zero is not None or packed.zero_const == (8 if kind == "int4" else 0)
    else:
        assert packed.data.dtype == torch.uint8 and packed.data.shape == (n, k)


def test_what_is_not_packable():
    w = torch.zeros(64, 8, dtype=torch.int8)
    assert not packable(w, torch.ones(64 // 24, 8), block_size=24)  # not a power of two
    assert not packable(w, torch.ones(16, 8), block_size=4)  # below one word of each plane
    assert not packable(w, torch.ones(8), block_size=0)  # per-channel INT4 is not a layout the kernel reads
    assert packable(w, torch.ones(2, 8), block_size=32)


# (kind, rows, K, N, group): every group size, rows 1..8 and the chunked 9..16, odd N, odd K (FP8).
CASES = [("fp8", 1, 64, 40, 0), ("fp8", 2, 97, 13, 0), ("fp8", 5, 200, 33, 0), ("fp8", 8, 128, 9, 0),
         ("fp8", 11, 96, 17, 0), ("int4", 1, 256, 33, 32), ("int4", 3, 96, 13, 32), ("int4", 7, 128, 5, 16),
         ("int4z", 4, 384, 11, 128), ("uint4", 2, 256, 21, 64), ("uint4z", 1, 512, 19, 128),
         ("uint4z", 6, 192, 9, 64), ("uint4z", 8, 64, 31, 32), ("int4", 16, 128, 7, 64), ("uint4", 5, 64, 3, 8)]


@pytest.mark.parametrize("kind,m,k,n,group", CASES)
def test_kernel_matches_the_reference(kind, m, k, n, group, kernel_device):
    gen = torch.Generator().manual_seed(m * k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen)
    x = _x(m, k, gen)
    args = [t.to(kernel_device) for t in (x, w, scale, zp, torch.tensor(1.0))]
    want = qmatmul_ref(*args, block_size=block)
    got = qmatmul_triton(*args, block_size=block)  # the GEMV for one row, the GEMM (test_qmatmul_gemm.py) for more
    assert got.shape == want.shape == (1, m, n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    gemv = qgemv(args[0].reshape(m, k), pack_weight(*args[1:4], block_size=block))
    torch.testing.assert_close(gemv, want.reshape(m, n), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", [ACT_STATIC, ACT_DYNAMIC])
@pytest.mark.parametrize("kind,m", [("fp8", 1), ("fp8", 3), ("int4", 2)])
def test_activation_quantization(kind, m, act, kernel_device):
    gen = torch.Generator().manual_seed(m + act)
    w, scale, zp, block = _weight(kind, 128, 24, 32, gen)
    x = _x(m, 128, gen)
    args = [t.to(kernel_device) for t in (x, w, scale, zp, _act_scale(x, act))]
    attrs = dict(block_size=block, act_mode=act, act_block_size=128 if act == ACT_DYNAMIC else 0)
    torch.testing.assert_close(qmatmul_triton(*args, **attrs), qmatmul_ref(*args, **attrs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,config", [("fp8", (1, 32, 1)), ("fp8", (8, 64, 2)), ("int4", (1, 32, 1)),
                                         ("int4", (2, 64, 2)), ("uint4z", (8, 128, 4))])
def test_other_configs(kind, config, kernel_device):
    """The configs benchmarks/quant_e2e.py sweeps compute the same product."""
    gen = torch.Generator().manual_seed(7)
    w, scale, zp, block = _weight(kind, 256, 19, 32, gen)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    for m in (1, 3):
        x = _x(m, 256, gen).reshape(m, 256).to(kernel_device)
        want = qmatmul_ref(x, *(t.to(kernel_device) for t in (w, scale, zp, torch.tensor(1.0))), block_size=block)
        torch.testing.assert_close(qgemv(x, packed, config), want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def programs_last_to_first(monkeypatch):
    """The Triton interpreter runs a grid's programs in order, so a program that stores rows it does not own is
    overwritten by the owner that runs after it; a GPU gives no order (the H100 kept the wrong rows). Running the
    programs last to first makes such a race lose on the CPU too. Interpreter internals (Triton 3.9)."""
    if torch.cuda.is_available():
        pytest.skip("reorders the Triton interpreter's programs; on CUDA the grid has no order to reverse")
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    forward = builder.set_grid_idx

    def backward(self, x, y, z):
        gx, gy, gz = self.grid_dim
        forward(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", backward)


@pytest.mark.parametrize("kind", ["fp8", "int4", "uint4z"])
def test_chunked_rows_store_only_their_own(kind, programs_last_to_first):
    """9..16 rows split over two programs of ROWS rows each, padded to ROWS_PAD: the first program's padding rows are
    the second's first rows (m = 12: rows 6, 7), which it must not store (its zeros won on the H100)."""
    gen = torch.Generator().manual_seed(5)
    w, scale, zp, block = _weight(kind, 64, 9, 32, gen)
    packed = pack_weight(w, scale, zp, block_size=block)
    for m in range(9, MAX_ROWS + 1):
        x = torch.randn(m, 64, generator=gen)
        torch.testing.assert_close(qgemv(x, packed, (8, 64, 4)), x @ dequantize_packed(packed), atol=1e-4, rtol=1e-4)


def test_weights_no_gemm_takes_run_the_reference_math(kernel_device):
    """INT4 groups of 8 values (below tl.dot's K of 16) at more rows than the GEMV takes: dequantize + one GEMM."""
    gen = torch.Generator().manual_seed(1)
    w, scale, zp, block = _weight("uint4z", 64, 24, 8, gen)
    x = _x(MAX_ROWS + 1, 64, gen).to(kernel_device)
    args = [t.to(kernel_device) for t in (x, w, scale, zp, torch.tensor(1.0))]
    want = qmatmul_ref(*args, block_size=block)
    torch.testing.assert_close(qmatmul_triton(*args, block_size=block), want)
    packed = pack_weight(*args[1:4], block_size=block)
    assert torch.equal(qmatmul_packed(x, packed, args[4]), want)  # the same dequantized values, the same GEMM


def test_launch_refusals():
    gen = torch.Generator().manual_seed(2)
    packed = pack_weight(*_weight("int4", 64, 8, 32, gen)[:3], block_size=32)
    with pytest.raises(ValueError, match="M <= "):
        qgemv(torch.zeros(MAX_ROWS + 1, 64), packed)
    with pytest.raises(ValueError, match="multiple of the group"):
        qgemv(torch.zeros(1, 64), packed, (1, 16, 1))
    codes = torch.zeros(1, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 codes only"):  # an INT4 weight, and FP8 codes without a row scale
        qgemv(codes, packed, row_scale=torch.ones(1), out_dtype=torch.float32)
    fp8 = pack_weight(*_weight("fp8", 64, 8, 0, gen)[:3], block_size=0)
    with pytest.raises(ValueError, match="FP8 codes only"):
        qgemv(codes, fp8)


def test_default_config_reads_whole_tiles():
    # FP8 at one row: a column a program, tiles of at most 2048 that divide K where one can
    assert default_config(1, 3072, 2048) == (4, 512, 2, 3)
    assert default_config(1, 4096, 14336) == (4, 512, 2, 3)  # 14336 = 28 · 512: no masked tile
    assert default_config(1, 4096, 576) == (4, 512, 2, 3)  # SmolLM2's hidden: a masked last tile
    assert default_config(1, 4096, 576, 0, 1) == (4, 512, 2, 3)  # FP8 codes (W8A8)
    assert default_config(1, 3072, 2048, 0, 4) == (4, 2048, 4)  # fp32 x: TILE_VALUES a tile
    # two rows (and kernel.py's fp32 INT4 GEMV): TILE_VALUES a tile
    assert default_config(2, 3072, 2048) == (4, 2048, 4)
    assert default_config(1, 4096, 14336, 128) == (4, 2048, 4)
    assert default_config(1, 2048, 8192, 128) == (2, 4096, 4)
    assert default_config(1, 24, 96, 32) == (8, 128, 4)


def test_default_config_half2():
    assert default_config_half2(1, 6144, 4096, 128) == (8, 1024, 2)
    assert default_config_half2(1, 24, 96, 32) == (8, 128, 2)  # K below the tile: one covering tile
    assert default_config_half2(1, 24, 96, 256) == (8, 256, 2)  # at least one group
    assert default_config_half2(2, 6144, 4096, 128) == (8, 4096, 4)


def test_default_config_xp():
    assert default_config_xp(1, 6144, 4096, 128) == (4, 1024, 2, 3)
    assert default_config_xp(1, 28672, 4096, 128) == (4, 512, 1, 3)  # many columns: one warp a program
    assert default_config_xp(2, 28672, 4096, 128) == (8, 512, 4, 1)
    assert default_config_xp(2, 4096, 14336, 128) == (4, 512, 2, 3)
    assert default_config_xp(1, 24, 96, 256) == (4, 256, 2, 3)  # at least one group
    assert default_config_xp(3, 6144, 4096, 128) == default_config_xp(4, 28672, 4096, 128) == (4, 512, 1, 3)


def test_gemv_max_rows_follows_the_xp_gemv():
    """INT4 weight-only steps on bf16/fp16 x take the GEMV up to 4 rows (the "half2_xp" path it was timed on);
    fp32 x, an FP8-quantized activation and FP8 weights keep 2."""
    gen = torch.Generator().manual_seed(0)
    int4 = pack_weight(*_weight("int4", 256, 8, 128, gen)[:3], block_size=128)
    fp8 = pack_weight(*_weight("fp8", 256, 8, 0, gen)[:3], block_size=0)
    assert gemv_max_rows(int4, torch.bfloat16) == gemv_max_rows(int4, torch.float16) == XP_GEMV_MAX_ROWS == 4
    assert gemv_max_rows(int4, torch.float32) == gemv_max_rows(int4, torch.bfloat16, ACT_STATIC) == GEMV_MAX_ROWS
    assert gemv_max_rows(fp8, torch.bfloat16) == GEMV_MAX_ROWS == 2


@pytest.mark.parametrize("m,path", [(3, "gemv"), (4, "gemv"), (5, "gemm")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_dispatch_takes_the_gemv_up_to_four_rows(m, path, dtype, kernel_device, monkeypatch):
    """qmatmul_packed on an INT4 weight launches the "half2_xp" GEMV for 3 and 4 rows of bf16 x and the Triton GEMM
    for 5; fp32 x (the "fp32" GEMV) keeps the GEMM from 3 rows. The launches are recorded by a pass-through
    wrapper of the real launcher; the result is checked against the reference too."""
    from trtopt.plugins import launcher
    from trtopt.plugins.qmatmul.gemm import _qgemm
    from trtopt.plugins.qmatmul.kernel_half2 import _qgemv_int4_xp

    launched = []
    real_launch = launcher.launch

    def recording_launch(kernel, *args, **kwargs):
        launched.append(kernel)
        real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    gen = torch.Generator().manual_seed(m)
    w, scale, zp, block = _weight("int4", 256, 24, 64, gen, dtype=dtype)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    x = _x(m, 256, gen).reshape(m, 256).to(dtype).to(kernel_device)
    got = qmatmul_packed(x, packed, None)
    want, other = (_qgemv_int4_xp, _qgemm) if path == "gemv" and dtype == torch.bfloat16 else (_qgemm, _qgemv_int4_xp)
    assert want in launched and other not in launched
    torch.testing.assert_close(got.float(), x.float() @ dequantize_packed(packed), atol=3e-2, rtol=2e-2)


# A decode step's real shapes (the 1.24B plan's O and down projections, the 8B's Q/K/V) at bf16, on CUDA.
GPU_SHAPES = [(8192, 2048), (4096, 6144)]  # (kept few: every case compiles its own kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU "
                    "machine)")
@pytest.mark.parametrize("kind,group", [("fp8", 0), ("int4", 128), ("uint4z", 32)])
@pytest.mark.parametrize("k,n", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_kernel_on_cuda_at_decode_shapes(kind, group, k, n, m):
    gen = torch.Generator().manual_seed(m + k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen, dtype=torch.bfloat16)
    x = _x(m, k, gen, torch.bfloat16).cuda()
    args = [x, *(t.cuda() for t in (w, scale, zp, torch.tensor(1.0)))]
    want = qmatmul_ref(*args, block_size=block)  # fp32 math, rounded to bf16
    packed = pack_weight(*args[1:4], block_size=block)
    got = qmatmul_packed(x, packed, args[4])
    # bf16 output: one rounding of an fp32 sum either way; different summation orders may straddle a bf16 step.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    exact = qgemv(x.reshape(m, k).float(), packed).float()  # fp32 x and output: fp32 rounding only
    want32 = x.reshape(m, k).float() @ dequantize_weight(*args[1:4], block_size=block)
    torch.testing.assert_close(exact, want32, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU "
                    "machine)")
@pytest.mark.parametrize("kind", ["fp8", "int4", "uint4z"])
@pytest.mark.parametrize("config", [(1, 1024, 4), (8, 512, 4), (2, 4096, 8), (4, 512, 2, 3), (2, 1024, 1, 4)])
def test_swept_configs_on_cuda(kind, config):
    gen = torch.Generator().manual_seed(3)
    w, scale, zp, block = _weight(kind, 4096, 1000, 128, gen, dtype=torch.bfloat16)
    packed = pack_weight(*(t.cuda() for t in (w, scale, zp)), block_size=block)
    want_w = dequantize_packed(packed)
    for m in (1, 12):
        x = torch.randn(m, 4096, generator=gen).cuda()
        torch.testing.assert_close(qgemv(x, packed, config), x @ want_w, atol=2e-3, rtol=1e-4)


# The INT4 GEMV in packed half2 arithmetic (kernel_half2.py, qgemv(variant="half2")): bf16/fp16 x only. On the CPU
# its plain-Triton twin runs (the same packed half2 words, fp32 products: every index, the packing and the scaling);
# the PTX runs in the `gpu` tests below. Its fp16 products and four-term sums round at ~2^-12 of a word's sum, so it
# is checked against the fp32 result relative to the output's scale, at bf16's tolerance.
HALF2_CASES = [("int4", 1, 256, 33, 32), ("int4", 2, 96, 13, 32), ("int4z", 2, 384, 11, 128),
               ("uint4", 1, 64, 3, 8), ("uint4z", 1, 512, 19, 128), ("uint4z", 2, 192, 9, 64),
               ("int4", 3, 128, 7, 16), ("int4z", 11, 64, 5, 32)]


def _half2_close(got: torch.Tensor, want: torch.Tensor, rel: float = 8e-3) -> None:
    """got (x's dtype) within rel · max|want| of the fp32 want: bf16's rounding plus the half2 sums'."""
    err = float((got.float() - want).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-30, (err, float(want.abs().max()))


HALF2_VARIANTS = ("half2", "half2_xp")  # x converted in the GEMV, or packed once by its own launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,m,k,n,group", HALF2_CASES)
def test_half2_variant_matches_the_reference(kind, m, k, n, group, dtype, kernel_device):
    gen = torch.Generator().manual_seed(m * k + n)
    w, scale, zp, block = _weight(kind, k, n, group, gen, dtype=dtype)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    x = _x(m, k, gen).reshape(m, k).to(dtype).to(kernel_device)
    want = x.float() @ dequantize_packed(packed)
    _half2_close(qgemv(x, packed, variant="half2"), want)
    _half2_close(qgemv(x, packed, (4, 2 * group, 2), variant="half2"), want)  # a masked last tile when K allows
    # x packed by its own launch: the same half2 words and sums, so the same values on the CPU's plain-Triton path
    torch.testing.assert_close(qgemv(x, packed, variant="half2_xp"), qgemv(x, packed, variant="half2"), atol=0,
                               rtol=0)
    _half2_close(qgemv(x, packed, (4, 2 * group, 2, 2), variant="half2_xp"), want)


@pytest.mark.parametrize("variant", HALF2_VARIANTS)
@pytest.mark.parametrize("x_scale", [3e3, 1e-4])
def test_half2_variant_scales_x_into_fp16s_range(x_scale, variant, kernel_device):
    """Activations of thousands (x · (q − z) overflows fp16 unscaled) and of 1e-4 (subnormal in fp16): the row's
    power-of-two scale keeps both exact."""
    gen = torch.Generator().manual_seed(11)
    w, scale, zp, block = _weight("uint4z", 256, 17, 64, gen, dtype=torch.bfloat16)
    packed = pack_weight(*(t.to(kernel_device) for t in (w, scale, zp)), block_size=block)
    x = (_x(2, 256, gen).reshape(2, 256) * x_scale).to(torch.bfloat16).to(kernel_device)
    got = qgemv(x, packed, variant=variant)
    assert torch.isfinite(got).all()
    _half2_close(got, x.float() @ dequantize_packed(packed))


def test_half2_variant_takes_fp32_x_to_the_fp32_kernel(kernel_device):
    gen = torch.Generator().manual_seed(4)
    packed = pack_weight(*(t.to(kernel_device) for t in _weight("int4", 64, 8, 32, gen)[:3]), block_size=32)
    x = torch.randn(1, 64, generator=gen).to(kernel_device)
    assert torch.equal(qgemv(x, packed, variant="half2"), qgemv(x, packed, variant="fp32"))
    with pytest.raises(ValueError, match="variant"):
        qgemv(x, packed, variant="fp16")


_COMPILE_HALF2 = """
import triton.language as tl
from trtopt.plugins.qmatmul.kernel_half2 import _qgemv_int4_half2
from trtopt.plugins.trt_common import compile_ptx
sig = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*u8", "Y": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
       "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
for rows, zero in ((1, 8), (2, -1), (3, 0)):
    kernel = compile_ptx(_qgemv_int4_half2, sig, dict(ROWS=rows, ROWS_PAD=4 if rows == 3 else rows, CHUNKS=1,
                         BLOCK_N=8, GROUP=128, GROUPS=32, TILE_GROUPS=16, K_TILES=2, ZERO=zero,
                         OUT_DTYPE=tl.bfloat16, X_CHUNK=1024, ASM=True), num_warps=2, num_stages=1,
                         target=("cuda", 90, 32))
    ptx = kernel.ptx
    assert ".target sm_90" in ptx and "lop3.b32" in ptx and "fma.rn.f16x2" in ptx and "cvt.rn.f16x2.f32" in ptx
    print(rows, ptx.count("fma.rn.f16x2"))
from trtopt.plugins.qmatmul.kernel_half2 import _pack_x_half2, _qgemv_int4_xp
sig_xp = {"XP": "*i32", "DOWN": "*fp32", **{k: v for k, v in sig.items() if k not in ("X", "stride_xm")}}
for rows, zero, stages in ((1, 8, 2), (2, -1, 1), (3, 0, 3)):
    ptx = compile_ptx(_qgemv_int4_xp, sig_xp, dict(ROWS=rows, ROWS_PAD=4 if rows == 3 else rows, CHUNKS=1,
                      BLOCK_N=8, GROUP=128, GROUPS=32, TILE_GROUPS=4, K_TILES=8, ZERO=zero, OUT_DTYPE=tl.bfloat16,
                      STAGES=stages, ASM=True), num_warps=4, num_stages=1, target=("cuda", 90, 32)).ptx
    assert ".target sm_90" in ptx and "lop3.b32" in ptx and "fma.rn.f16x2" in ptx
ptx = compile_ptx(_pack_x_half2, {"X": "*bf16", "XP": "*i32", "DOWN": "*fp32", "stride_xm": "i32"},
                  dict(K=4096, GROUP=128, X_CHUNK=1024, CHUNK_WORDS=512, ASM=True), num_warps=4, num_stages=1,
                  target=("cuda", 90, 32)).ptx
assert "cvt.rn.f16x2.f32" in ptx
"""


def test_half2_gemv_compiles_for_sm90():
    """The PTX path (inline asm) lowers for sm_90 on this CPU machine, in a fresh process (this one may be in
    interpreter mode), as tests/runtime/test_kernels_compile.py does for the runtime's kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_HALF2], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.split("\n")) >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU "
                    "machine)")
@pytest.mark.parametrize("kind,group", [("int4", 128), ("uint4z", 32), ("int4z", 16)])
@pytest.mark.parametrize("k,n", [(8192, 2048), (14336, 37), (640, 1000)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", HALF2_VARIANTS)
def test_half2_on_cuda_matches_the_reference(kind, group, k, n, m, variant):
    """The PTX path against qmatmul_ref at the bf16 tolerance of test_kernel_on_cuda_at_decode_shapes, and
    against the fp32 product relative to the output's scale; odd N, K not a multiple of the tile (640)."""
    gen = torch.Generator().manual_seed(m + k + n + group)
    w, scale, zp, block = _weight(kind, k, n, group, gen, dtype=torch.bfloat16)
    x = _x(m, k, gen, torch.bfloat16).cuda()
    args = [x, *(t.cuda() for t in (w, scale, zp, torch.tensor(1.0)))]
    want = qmatmul_ref(*args, block_size=block).reshape(m, n)
    packed = pack_weight(*args[1:4], block_size=block)
    got = qgemv(x.reshape(m, k), packed, variant=variant)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    _half2_close(got, x.reshape(m, k).float() @ dequantize_packed(packed))
    for x_scale in (3e3, 1e-4):  # the row's power-of-two scale: no fp16 overflow, no subnormal x
        xs = (x.reshape(m, k).float() * x_scale).to(torch.bfloat16)
        got = qgemv(xs, packed, variant=variant)
        assert torch.isfinite(got).all()
        _half2_close(got, xs.float() @ dequantize_packed(packed))
