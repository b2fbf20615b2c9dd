"""The QMatMul Triton GEMV vs the torch reference at odd shapes, for FP8 and INT4/UINT4 weights and every
activation mode. Without CUDA it runs under the Triton interpreter (tests/plugins/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from trtopt.plugins.qmatmul.kernel import MAX_ROWS, qmatmul_triton
from trtopt.plugins.qmatmul.reference import qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC


def _inputs(kind: str, m: int, k: int, n: int, group: int, act: int, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, m, k, generator=gen)
    if kind == "fp8":
        w = (torch.randn(k, n, generator=gen) * 50).to(torch.float8_e4m3fn)
        scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
        zp, block = torch.full((n,), -0.0).to(torch.float8_e4m3fn), 0  # -0 is a zero point of 0 too
    else:
        lo, hi, dtype = (-8, 8, torch.int8) if kind == "int4" else (0, 16, torch.uint8)
        w = torch.randint(lo, hi, (k, n), generator=gen).to(dtype)
        scale = torch.rand(k // group, n, generator=gen) * 0.1 - 0.05  # signed, as ORT's symmetric quantizer
        zp = (torch.randint(lo, hi, (k // group, n), generator=gen) if kind == "uint4"
              else torch.zeros(k // group, n)).to(dtype)
        block = group
    if act == ACT_DYNAMIC:
        act_scale = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
    else:
        act_scale = torch.tensor(0.02)
    args = [t.to(device) for t in (x, w, scale, zp, act_scale)]
    return args, dict(block_size=block, act_mode=act, act_block_size=k if act == ACT_DYNAMIC else 0)


@pytest.mark.parametrize("kind,act", [("fp8", ACT_NONE), ("fp8", ACT_STATIC), ("fp8", ACT_DYNAMIC), ("int4", ACT_NONE),
                                      ("uint4", ACT_NONE)])
@pytest.mark.parametrize("m,k,n,group", [(1, 64, 40, 32), (3, 96, 13, 32), (7, 256, 70, 128), (16, 128, 129, 64)])
def test_kernel_matches_the_reference(kind, act, m, k, n, group, kernel_device):
    args, attrs = _inputs(kind, m, k, n, group, act, kernel_device, seed=m * k + n)
    got = qmatmul_triton(*args, None, **attrs)
    want = qmatmul_ref(*args, None, **attrs)
    assert got.shape == want.shape == (1, m, n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_more_rows_than_a_gemv_run_the_reference(kernel_device):
    args, attrs = _inputs("int4", MAX_ROWS + 1, 64, 24, 32, ACT_NONE, kernel_device, seed=1)
    torch.testing.assert_close(qmatmul_triton(*args, None, **attrs), qmatmul_ref(*args, None, **attrs))
