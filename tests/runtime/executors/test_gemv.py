"""The decode-sized GEMV kernels (runtime/gemv_kernel.py) against torch, and the executor's opt-in rewrite that uses
them (runtime/executors/gemv.py). Without CUDA the kernels run under the Triton interpreter (set here before the
kernel module is imported) with small tiles; the `gpu` tests run the executor path on a real GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.build.plan import read_plan  # noqa: E402
from trtopt.plugins.silu_mul.reference import silu_mul_ref  # noqa: E402
from trtopt.runtime.executors import gemv  # noqa: E402
from trtopt.runtime.executors.torch_executor import TorchExecutor  # noqa: E402
from trtopt.runtime.gemv_kernel import (  # noqa: E402
    GEMV_CONFIG, GEMV_SILU_MUL_CONFIG, MAX_ROWS, gemv_silu_mul_triton, gemv_triton,
)

from packed_steps import prefill_then_decode  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = (8, 32, 4)  # tiles that make the interpreter walk several programs and K steps on small shapes
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 64, 40), (3, 100, 17), (8, 96, 64), (2, 33, 9)])
def test_gemv_matches_torch(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    x, w = _inputs(m, k, n, dtype, seed=m + k + n)
    got = gemv_triton(x, w, SMALL if DEVICE.type == "cpu" else GEMV_CONFIG)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()).to(dtype).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,inter", [(1, 64, 24), (4, 70, 33), (8, 32, 8)])
def test_gemv_silu_mul_matches_the_unfused_pair(m: int, k: int, inter: int, dtype: torch.dtype) -> None:
    """gate/up GEMM rounded to the dtype, then SiluMul's reference: what the unfused pair computes."""
    x, w = _inputs(m, k, 2 * inter, dtype, seed=m * k)
    got = gemv_silu_mul_triton(x, w, SMALL if DEVICE.type == "cpu" else GEMV_SILU_MUL_CONFIG)
    gu = (x.float() @ w.float().t()).to(dtype)
    want = silu_mul_ref(gu[:, :inter], gu[:, inter:])
    assert got.shape == (m, inter) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_kernels_refuse_what_they_cannot_do() -> None:
    x, w = _inputs(MAX_ROWS + 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="M <="):
        gemv_triton(x, w)
    with pytest.raises(ValueError, match="one float dtype"):
        gemv_triton(x[:2], w.half())
    with pytest.raises(ValueError, match="even number"):
        gemv_silu_mul_triton(x[:2], w[:7])


def test_off_cuda_the_rewritten_calls_are_the_linear_path_exactly() -> None:
    x, w = _inputs(2, 16, 12, torch.float32)
    x, w = x.cpu(), w.cpu()
    assert torch.equal(gemv.small_m_linear(x, w), torch.nn.functional.linear(x, w))
    gate, up = torch.nn.functional.linear(x, w).split(6, dim=-1)
    assert torch.equal(gemv.small_m_linear_silu_mul(x, w, sizes=[6, 6], axis=-1), silu_mul_ref(gate, up))


def _steps(ex: TorchExecutor, plan) -> list[torch.Tensor]:
    """A packed prefill (27 rows: the F.linear path) and a decode step of two rows (the GEMV path on CUDA)."""
    return prefill_then_decode(ex, plan.limits.block_size)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_executor_rewrites_every_projection_and_keeps_the_logits(model: str, plan_dir) -> None:
    built = plan_dir(model)
    plan = read_plan(built)
    layers = plan.model.num_layers
    ex = TorchExecutor(built, plan, small_m_gemv=True)
    assert ex.num_linear_weights == 4 * layers + 1
    assert ex.num_gemv == (3 * layers + 1, layers)  # Q/K/V, O, down and the LM head; gate/up fused with SiLU·mul
    names = [getattr(n.target, "__name__", "") for n in ex.graph.module.graph.nodes]
    assert "silu_mul" not in names and "linear" not in names
    for a, b in zip(_steps(ex, plan), _steps(TorchExecutor(built, plan), plan)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_executor_gemv_path_on_gpu(model: str, plan_dir) -> None:
    """On CUDA the two-row decode step runs the GEMV kernels: its logits agree with the cuBLAS path (fp32)."""
    built = plan_dir(model)
    plan = read_plan(built)
    got = _steps(TorchExecutor(built, plan, device="cuda", small_m_gemv=True), plan)
    want = _steps(TorchExecutor(built, plan, device="cuda"), plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
