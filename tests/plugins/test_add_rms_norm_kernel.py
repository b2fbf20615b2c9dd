"""The AddRMSNorm Triton kernel vs the unfused pair it replaces (Add, then RMSNorm's Triton kernel on CUDA, its
reference under the interpreter), and the CPU reference's bit-identity with the unfused ops."""

from __future__ import annotations

import os

import pytest
import torch

from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_triton
from trtopt.plugins.add_rms_norm.reference import add_rms_norm_ref
from trtopt.plugins.rms_norm.kernel import rms_norm_triton
from trtopt.plugins.rms_norm.reference import rms_norm_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = torch.randn(*shape, generator=gen) * 3, torch.randn(*shape, generator=gen) * 3
    scale = torch.rand(shape[-1], generator=gen) + 0.5
    return x.to(device, dtype), r.to(device, dtype), scale.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 7, 96), (2, 1000)], ids=str)
def test_kernel_matches_the_unfused_pair(shape, dtype, kernel_device):
    x, r, scale = inputs(shape, dtype, kernel_device, seed=sum(shape))
    y, s = add_rms_norm_triton(x, r, scale, epsilon=1e-6)
    exact = x + r
    if os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        torch.testing.assert_close(s, exact, atol=2 * 2**-8 * float(exact.abs().max()), rtol=2**-7)  # truncation
    else:
        assert torch.equal(s, exact)
    torch.testing.assert_close(y, rms_norm_ref(exact, scale, epsilon=1e-6), **TOL[dtype])


def test_reference_is_bit_identical_to_the_unfused_ops():
    x, r, scale = inputs((4, 9, 160), torch.float32, "cpu")
    y, s = add_rms_norm_ref(x, r, scale, epsilon=1e-5)
    assert torch.equal(s, x + r) and torch.equal(y, rms_norm_ref(x + r, scale, epsilon=1e-5))


def test_kernel_refuses_a_broadcast(kernel_device):
    x, r, scale = inputs((2, 3, 64), torch.float32, kernel_device)
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm_triton(x, r[:1], scale, epsilon=1e-5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 8192, 2048), (1, 17, 576), (64, 1, 8192)], ids=str)
def test_kernel_is_bit_identical_to_add_then_rms_norm_kernel_on_gpu(shape, dtype):
    x, r, scale = inputs(shape, dtype, "cuda", seed=sum(shape))
    y, s = add_rms_norm_triton(x, r, scale, epsilon=1e-6)
    assert torch.equal(s, x + r)
    assert torch.equal(y, rms_norm_triton(x + r, scale, epsilon=1e-6))
