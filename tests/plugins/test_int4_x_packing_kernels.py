"""The xp forms of the kernels that produce an INT4 projection's input (plugins/rms_norm/kernel.py
`rms_norm_xp_triton`, plugins/add_rms_norm/kernel.py `add_rms_norm_xp_triton`, plugins/silu_mul/kernel.py
`silu_mul_xp_triton`, plugins/gelu_mul/kernel.py `gelu_mul_xp_triton`): one launch that stores the op's row and packs
it for the INT4 "half2_xp" GEMV, bit for bit the op's kernel followed by the separate x launch
(plugins/qmatmul/kernel.py `pack_x_half2`), which is what the projection ran before the torch executor fused them
(runtime/executors/qmatmul_packing.py `fuse_norm_pack_x`). On the GPU and under the interpreter alike."""

from __future__ import annotations

import pytest
import torch

from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_triton, add_rms_norm_xp_triton
from trtopt.plugins.gelu_mul.kernel import gelu_mul_triton, gelu_mul_xp_triton
from trtopt.plugins.qmatmul.kernel import XP_GEMV_MAX_ROWS, pack_x_half2
from trtopt.plugins.rms_norm.kernel import rms_norm_triton, rms_norm_xp_triton
from trtopt.plugins.silu_mul.kernel import silu_mul_triton, silu_mul_xp_triton


def _forms(rows: int, n: int, group: int, dtype: torch.dtype, device, scale_dtype=None):
    """{op: ((y, xpack, down) of the xp form, y of the plain kernel)} on rows of growing magnitude."""
    gen = torch.Generator().manual_seed(rows * n + group)
    x = (torch.randn(rows, n, generator=gen) * torch.logspace(-2, 2, rows).reshape(-1, 1)).to(device, dtype)
    r = (torch.randn(rows, n, generator=gen) * 2).to(device, dtype)
    scale = (torch.rand(n, generator=gen) + 0.5).to(device, scale_dtype or dtype)
    gate_up = torch.randn(rows, 2 * n, generator=gen).to(device, dtype) * 3
    gate, up = gate_up[:, :n], gate_up[:, n:]  # strided halves, as the horizontal gate/up fusion hands them over
    add = add_rms_norm_xp_triton(x, r, scale, epsilon=1e-6, group=group)
    plain_add = add_rms_norm_triton(x, r, scale, epsilon=1e-6)
    assert torch.equal(add[1], plain_add[1])  # the sum (the next residual)
    return {"rms": (rms_norm_xp_triton(x, scale, epsilon=1e-6, group=group), rms_norm_triton(x, scale, epsilon=1e-6)),
            "add": ((add[0], *add[2:]), plain_add[0]),
            "silu": (silu_mul_xp_triton(gate, up, group=group), silu_mul_triton(gate, up)),
            "gelu": (gelu_mul_xp_triton(gate, up, tanh=1, group=group), gelu_mul_triton(gate, up, tanh=1))}


@pytest.mark.parametrize("rows,n,group", [(1, 256, 128), (3, 576, 64), (4, 320, 32), (2, 2304, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_xp_forms_are_the_op_then_the_x_launch(rows, n, group, dtype, kernel_device):
    """y equals the plain kernel's and (xpack, down) the separate x launch's on that y, bit for bit, at 1, 3 and 4
    rows; SmolLM2's 576 (9 groups of 64), a K of 10 groups of 32, and 288 words (more than one program of the x
    launch packs: the xp form walks the row in slices)."""
    for name, ((y, xpack, down), want_y) in _forms(rows, n, group, dtype, kernel_device).items():
        want_xpack, want_down = pack_x_half2(want_y, group)
        assert y.dtype == want_y.dtype and torch.equal(y, want_y), name
        assert xpack is not None and torch.equal(xpack, want_xpack), name
        assert torch.equal(down, want_down), name


def test_xp_forms_write_only_y_where_the_step_runs_no_xp_gemv(kernel_device):
    """More rows than the GEMV takes, or an fp32 y (which the half2 GEMV would round), or a K that the group does not
    divide: the plain launch, and no packed x."""
    cases = [(XP_GEMV_MAX_ROWS + 1, 256, 128, torch.bfloat16, None), (2, 256, 128, torch.float32, None),
             (2, 256, 128, torch.bfloat16, torch.float32),  # Gemma's fp32 scale: an fp32 y
             (1, 96, 64, torch.bfloat16, None)]
    for rows, n, group, dtype, scale_dtype in cases:
        for name, ((y, xpack, down), want_y) in _forms(rows, n, group, dtype, kernel_device, scale_dtype).items():
            if scale_dtype is not None and name in ("silu", "gelu"):  # no scale: a bf16 y, packed
                assert xpack is not None, name
                continue
            assert xpack is None and down is None and torch.equal(y, want_y), (name, rows, dtype, scale_dtype)
