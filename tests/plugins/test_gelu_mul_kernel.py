"""The GeluMul Triton kernel vs HF's ops (torch's gelu, then · up), and the CPU reference's bit-identity with the
exporters' decomposed GELU, in both forms (tanh approximation and exact erf).

Without CUDA the kernel runs under the Triton interpreter (tests/plugins/conftest.py); the `gpu` sweep adds
model-sized rows (Gemma-3-270m's MLP is 2048 wide, Gemma-3-1B's 6912) and the strided halves of a gate/up Split.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from gate_up import gate_up_inputs

from trtopt.plugins.gelu_mul.kernel import gelu_mul_triton
from trtopt.plugins.gelu_mul.reference import gelu_mul_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMS = [1, 0]
FORM_IDS = ["tanh", "erf"]


def hf(g, u, tanh):
    """HF's GeGLU: act_fn(gate) * up with torch's gelu (gelu_pytorch_tanh for tanh=1)."""
    return F.gelu(g, approximate="tanh" if tanh else "none") * u


inputs = functools.partial(gate_up_inputs, gate_scale=3)


def _tol(dtype):
    # exp/erf differ from torch's by an ulp or so in fp32; one rounding step of the dtype otherwise (the interpreter
    # also truncates fp32 → bf16 rather than rounding).
    return {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


@pytest.mark.parametrize("tanh", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,split", [((1, 5, 64), False), ((3, 7, 96), True), ((2, 5000), False)], ids=str)
def test_kernel_matches_hf(shape, split, dtype, tanh, kernel_device):
    g, u = inputs(shape, dtype, kernel_device, seed=sum(shape), split=split)
    out = gelu_mul_triton(g, u, tanh=tanh)
    assert out.is_contiguous() and out.dtype == dtype and out.shape == g.shape
    torch.testing.assert_close(out, hf(g, u, tanh), **_tol(dtype))


def test_kernel_has_no_cancellation_far_out():
    """Large |g| (the GELU's tails: −g·σ(−2z) → −0, g → g) and g = 0 on the kernel's tanh form, fp32."""
    g = torch.tensor([[-40.0, -12.0, -6.0, -1e-3, 0.0, 1e-3, 6.0, 12.0, 40.0]])
    u = torch.ones_like(g)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = gelu_mul_triton(g.to(device), u.to(device), tanh=1).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, hf(g, u, 1), atol=1e-6, rtol=1e-5)


def _decomposed(g, u, tanh, legacy):
    """The exporters' graphs op by op (each result rounded to the dtype, constants as Python numbers, as the torch
    executor runs them): dynamo's Pow and g·(0.5·(1 + t)); legacy's g·(g·g) and (g·(1 + t))·0.5."""
    if tanh:
        cube = g * (g * g) if legacy else torch.pow(g, 3.0)
        t = torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * cube))
    else:
        t = torch.erf(g / math.sqrt(2))
    act = (g * (t + 1.0)) * 0.5 if legacy else g * (0.5 * (t + 1.0))
    return act * u


@pytest.mark.parametrize("tanh", FORMS, ids=FORM_IDS)
def test_reference_is_bit_identical_to_the_exported_ops(tanh):
    g, u = inputs((4, 33, 160), torch.float32, "cpu", split=True)
    ref = gelu_mul_ref(g, u, tanh=tanh)
    assert torch.equal(ref, _decomposed(g, u, tanh, legacy=False))
    assert torch.equal(ref, _decomposed(g, u, tanh, legacy=True))
    torch.testing.assert_close(ref, hf(g, u, tanh), atol=1e-5, rtol=1e-5)  # and the same function as HF's


def test_kernel_refuses_mismatched_inputs(kernel_device):
    g, u = inputs((2, 8), torch.float32, kernel_device)
    with pytest.raises(ValueError, match="one shape"):
        gelu_mul_triton(g, u[:, :4], tanh=1)
    with pytest.raises(ValueError, match="float dtype"):
        gelu_mul_triton(g, u.double(), tanh=1)
    assert gelu_mul_triton(g[:0], u[:0], tanh=1).shape == (0, 8)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tanh", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 300, 2048), (1, 17, 6912), (64, 1, 6912)], ids=str)
def test_kernel_matches_hf_on_gpu(shape, dtype, tanh):
    g, u = inputs(shape, dtype, "cuda", seed=sum(shape), split=True)
    out = gelu_mul_triton(g, u, tanh=tanh)
    # On the GPU only exp/erf's last-ulp differences remain: at most one rounding step of the dtype.
    torch.testing.assert_close(out, hf(g, u, tanh), **_tol(dtype))
    assert os.environ.get("TRITON_INTERPRET") != "1"
