"""The SiluMul Triton kernel vs the unfused ops (Sigmoid → Mul → Mul), and the CPU reference's bit-identity.

Without CUDA the kernel runs under the Triton interpreter (tests/plugins/conftest.py); the `gpu` sweep adds
model-sized rows and the strided halves of a gate/up Split.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from gate_up import gate_up_inputs

from trtopt.plugins.silu_mul.kernel import silu_mul_triton
from trtopt.plugins.silu_mul.reference import silu_mul_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def unfused(g, u):
    return g * torch.sigmoid(g) * u


inputs = functools.partial(gate_up_inputs, gate_scale=4)


def _tol(dtype):
    # exp differs from torch's by an ulp or so in fp32; one rounding step of the dtype otherwise (the interpreter
    # also truncates fp32 → bf16 rather than rounding).
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,split", [((1, 5, 64), False), ((3, 7, 96), True), ((2, 5000), False)], ids=str)
def test_kernel_matches_the_unfused_ops(shape, split, dtype, kernel_device):
    g, u = inputs(shape, dtype, kernel_device, seed=sum(shape), split=split)
    out = silu_mul_triton(g, u)
    assert out.is_contiguous() and out.dtype == dtype and out.shape == g.shape
    torch.testing.assert_close(out, unfused(g, u), **_tol(dtype))


def test_reference_is_bit_identical_to_the_unfused_ops():
    for dtype in (torch.float32, torch.bfloat16):
        g, u = inputs((4, 33, 160), dtype, "cpu", split=True)
        assert torch.equal(silu_mul_ref(g, u), unfused(g, u))


def test_kernel_refuses_mismatched_inputs(kernel_device):
    g, u = inputs((2, 8), torch.float32, kernel_device)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_triton(g, u[:, :4])
    with pytest.raises(ValueError, match="float dtype"):
        silu_mul_triton(g, u.double())
    assert silu_mul_triton(g[:0], u[:0]).shape == (0, 8)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 8192), (1, 300, 8192), (1, 17, 1536), (64, 1, 5632)], ids=str)
def test_kernel_matches_the_unfused_ops_on_gpu(shape, dtype):
    g, u = inputs(shape, dtype, "cuda", seed=sum(shape), split=True)
    out = silu_mul_triton(g, u)
    # On the GPU only exp's last-ulp differences remain: at most one rounding step of the dtype.
    torch.testing.assert_close(out, unfused(g, u), **_tol(dtype))
    assert os.environ.get("TRITON_INTERPRET") != "1"
