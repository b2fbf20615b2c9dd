"""The FP8 forms of the kernels that produce a W8A8 projection's input (plugins/rms_norm/kernel.py
`rms_norm_fp8_triton`, plugins/add_rms_norm/kernel.py `add_rms_norm_fp8_triton`, plugins/silu_mul/kernel.py
`silu_mul_fp8_triton`, plugins/gelu_mul/kernel.py `gelu_mul_fp8_triton`): one launch that computes a row and
quantizes it to FP8 under its dynamic per-token scale, bit for bit the op's kernel followed by the activation's
quantize launch (plugins/qmatmul/gemm.py `quantize_fp8_rows` with a `DynamicScale`), which is what the projection
ran before the torch executor fused them (runtime/executors/qmatmul_packing.py `fuse_norm_quantize`). On the GPU
and under the interpreter alike."""

from __future__ import annotations

import pytest
import torch

from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_fp8_triton, add_rms_norm_triton
from trtopt.plugins.gelu_mul.kernel import gelu_mul_fp8_triton, gelu_mul_triton
from trtopt.plugins.qmatmul.gemm import DynamicScale, quantize_fp8_rows
from trtopt.plugins.rms_norm.kernel import rms_norm_fp8_triton, rms_norm_triton
from trtopt.plugins.silu_mul.kernel import silu_mul_fp8_triton, silu_mul_triton

MIN_SCALE = 2.0 ** -24
# (x dtype, scale dtype): the plan's dtype, and Gemma's fp32 scale on half-precision rows
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32)]


def _rows(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[-2]).reshape(-1, 1)
    x[..., 0, :] = 0.0  # a row of zeros: the minimum scale
    return x.to(device, dtype), (torch.randn(*shape, generator=gen) * 2).to(device, dtype)


def _quantized(y: torch.Tensor, act_scale: torch.Tensor | None = None):
    """The quantize launch's codes and row scales of y: under the static act_scale, else the dynamic scale."""
    codes, row_scale = quantize_fp8_rows(y.reshape(-1, y.shape[-1]), act_scale,
                                         None if act_scale is not None else DynamicScale(y.dtype, MIN_SCALE))
    return codes.view(torch.uint8).reshape(y.shape), row_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_static_scales_are_the_quantize_launchs_codes_of_every_form(dtype, kernel_device):
    """Under a static per-tensor scale (a calibrated W8A8 plan's), every FP8 form gives the quantize launch's codes
    (saturating where the row exceeds the scale's range) and the scale as every row's; a scale of more than one
    value is refused."""
    x, r = _rows((2, 3, 2 * 96), dtype, kernel_device, 11)
    scale = torch.rand(2 * 96, generator=torch.Generator().manual_seed(3)).to(kernel_device, dtype) + 0.5
    s = torch.tensor(0.004, dtype=dtype, device=kernel_device)  # small: some codes saturate at 448
    gate, up = x.chunk(2, dim=-1)
    cases = {"rms": (rms_norm_fp8_triton(x, scale, epsilon=1e-6, act_scale=s), rms_norm_triton(x, scale, epsilon=1e-6)),
             "add": (add_rms_norm_fp8_triton(x, r, scale, epsilon=1e-6, act_scale=s)[1:],
                     add_rms_norm_triton(x, r, scale, epsilon=1e-6)[0]),
             "silu": (silu_mul_fp8_triton(gate, up, act_scale=s), silu_mul_triton(gate, up)),
             "gelu": (gelu_mul_fp8_triton(gate, up, tanh=1, act_scale=s), gelu_mul_triton(gate, up, tanh=1))}
    for name, ((codes, row_scale, out_dtype), y) in cases.items():
        want_codes, want_scale = _quantized(y, s)
        assert torch.equal(codes.view(torch.uint8), want_codes), name
        assert torch.equal(row_scale, want_scale) and (row_scale == float(s)).all(), name
    assert int((cases["rms"][0][0].view(torch.uint8) & 0x7F).max()) == 0x7E  # saturated somewhere
    with pytest.raises(ValueError, match="per tensor"):
        rms_norm_fp8_triton(x, scale, epsilon=1e-6, act_scale=torch.ones(2, device=kernel_device))


@pytest.mark.parametrize("dtype,scale_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 64), (2, 5, 96), (7, 1000)], ids=str)
def test_rms_norm_fp8_is_the_norm_then_the_quantize_launch(shape, dtype, scale_dtype, kernel_device):
    x, _ = _rows(shape, dtype, kernel_device, sum(shape))
    scale = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5).to(kernel_device, scale_dtype)
    codes, row_scale, out_dtype = rms_norm_fp8_triton(x, scale, epsilon=1e-6, min_scale=MIN_SCALE)
    y = rms_norm_triton(x, scale, epsilon=1e-6)
    want_codes, want_scale = _quantized(y)
    assert out_dtype == y.dtype and codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(row_scale, want_scale)
    assert float(row_scale[0]) == MIN_SCALE  # the zero row
    assert int((codes.view(torch.uint8) & 0x7F).max()) == 0x7E  # each row's largest |y| lands on 448


@pytest.mark.parametrize("dtype,scale_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 64), (3, 700)], ids=str)
def test_add_rms_norm_fp8_is_the_fused_add_norm_then_the_quantize_launch(shape, dtype, scale_dtype, kernel_device):
    x, r = _rows(shape, dtype, kernel_device, sum(shape) + 1)
    scale = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(2)) + 0.5).to(kernel_device, scale_dtype)
    total, codes, row_scale, out_dtype = add_rms_norm_fp8_triton(x, r, scale, epsilon=1e-5, min_scale=MIN_SCALE)
    y, want_total = add_rms_norm_triton(x, r, scale, epsilon=1e-5)
    want_codes, want_scale = _quantized(y)
    assert out_dtype == y.dtype and torch.equal(total, want_total)
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(row_scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,split", [((1, 4, 96), False), ((5, 2 * 300), True)], ids=str)
def test_silu_mul_fp8_is_the_kernel_then_the_quantize_launch(shape, split, dtype, kernel_device):
    """gate and up as given, or as the two halves of one tensor (the horizontal gate/up fusion's Split)."""
    x, up = _rows(shape, dtype, kernel_device, sum(shape) + 2)
    gate = x
    if split:
        gate, up = x.chunk(2, dim=-1)
    codes, row_scale, out_dtype = silu_mul_fp8_triton(gate, up, min_scale=MIN_SCALE)
    y = silu_mul_triton(gate, up)
    want_codes, want_scale = _quantized(y)
    assert out_dtype == dtype and codes.shape == gate.shape
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(row_scale, want_scale)


@pytest.mark.parametrize("tanh", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_mul_fp8_is_the_kernel_then_the_quantize_launch(dtype, tanh, kernel_device):
    x, _ = _rows((2, 3, 2 * 160), dtype, kernel_device, 7 + tanh)
    gate, up = x.chunk(2, dim=-1)
    codes, row_scale, out_dtype = gelu_mul_fp8_triton(gate, up, tanh=tanh, min_scale=MIN_SCALE)
    want_codes, want_scale = _quantized(gelu_mul_triton(gate, up, tanh=tanh))
    assert out_dtype == dtype
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(row_scale, want_scale)


def test_silu_mul_fp8_rows_longer_than_a_block_run_the_two_launches(kernel_device):
    from trtopt.plugins.qmatmul.gemm import QUANTIZE_BLOCK_K

    gate, up = _rows((2, QUANTIZE_BLOCK_K + 8), torch.float32, kernel_device, 3)
    codes, row_scale, _ = silu_mul_fp8_triton(gate, up, min_scale=MIN_SCALE)
    want_codes, want_scale = _quantized(silu_mul_triton(gate, up))
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(row_scale, want_scale)


def test_empty_rows_and_bad_scales(kernel_device):
    x = torch.zeros(0, 64, device=kernel_device)
    codes, row_scale, _ = rms_norm_fp8_triton(x, torch.ones(64, device=kernel_device), epsilon=1e-6,
                                              min_scale=MIN_SCALE)
    assert codes.shape == (0, 64) and row_scale.shape == (0, 1)
    with pytest.raises(ValueError, match="scale must be"):
        rms_norm_fp8_triton(torch.ones(2, 64, device=kernel_device), torch.ones(32, device=kernel_device),
                            epsilon=1e-6, min_scale=MIN_SCALE)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_fp8_triton(torch.ones(2, 64, device=kernel_device), torch.ones(2, 32, device=kernel_device),
                            min_scale=MIN_SCALE)
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm_fp8_triton(torch.ones(2, 64, device=kernel_device), torch.ones(1, 64, device=kernel_device),
                                torch.ones(64, device=kernel_device), epsilon=1e-6, min_scale=MIN_SCALE)
