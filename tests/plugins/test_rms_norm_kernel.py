"""The RMSNorm Triton kernel vs the torch reference.

Without CUDA these run under the Triton interpreter (tests/plugins/conftest.py); the `gpu` sweep adds model-sized
rows. Outputs are compared in full, so a row the kernel skipped (torch.empty garbage) cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from trtopt.plugins.rms_norm.kernel import rms_norm_triton
from trtopt.plugins.rms_norm.reference import rms_norm_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def check(shape, x_dtype, scale_dtype, device, seed=0, eps=1e-6, transpose=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    if transpose:  # a non-contiguous view whose last dim is still contiguous after reshape's copy
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    scale = torch.rand(shape[-1], generator=gen) + 0.5
    x, scale = x.to(device, x_dtype), scale.to(device, scale_dtype)
    out = rms_norm_triton(x, scale, epsilon=eps)
    ref = rms_norm_ref(x, scale, epsilon=eps)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    # The normalised row is rounded to x's dtype before the scale (as the reference does), and the kernel's 1/sqrt
    # and torch's rsqrt may differ by an fp32 ulp, which can move that rounding by one ulp of x's dtype (seen on an
    # H200: fp16 x, fp32 scale, one element of 2016 off by 6e-4). So the tolerance is that of x's dtype when lower.
    low = x_dtype if torch.finfo(x_dtype).eps > torch.finfo(ref.dtype).eps else ref.dtype
    torch.testing.assert_close(out, ref, **TOL[low])


@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 7, 96), (1, 1, 48), (2, 1000)], ids=str)
@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float32)], ids=str)
def test_kernel_matches_reference(shape, x_dtype, scale_dtype, kernel_device):
    check(shape, x_dtype, scale_dtype, kernel_device)


def test_strided_input_and_empty_batch(kernel_device):
    check((6, 4, 80), torch.float32, torch.float32, kernel_device, transpose=True)
    empty = rms_norm_triton(torch.zeros(0, 3, 64, device=kernel_device), torch.ones(64, device=kernel_device),
                            epsilon=1e-5)
    assert empty.shape == (0, 3, 64)


def test_bad_inputs_are_refused(kernel_device):
    x = torch.randn(2, 64, device=kernel_device)
    with pytest.raises(ValueError, match="scale must be"):
        rms_norm_triton(x, torch.ones(32, device=kernel_device), epsilon=1e-5)
    with pytest.raises(ValueError, match="supports"):
        rms_norm_triton(x.double(), torch.ones(64, device=kernel_device), epsilon=1e-5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 8192, 2048), (1, 300, 4096), (1, 17, 576), (64, 1, 8192)], ids=str)
def test_kernel_matches_reference_on_gpu(shape, dtype):
    check(shape, dtype, dtype, torch.device("cuda"), seed=sum(shape))
