"""SiluMul as one Triton kernel (face 4 of docs/architecture.md §4): the CUDA path of the torch executor.

The exported SwiGLU is three kernels per layer (Sigmoid, Mul, Mul) that each read and write the [T, I]
intermediate; here one program reads gate and up once and writes y once. gate and up may be strided views (the
horizontal gate/up fusion hands them over as the two halves of one Split), as long as the last axis is dense.

The rounding is the unfused graph's, step for step: sigmoid in fp32 rounded to the dtype, gate·s rounded, then ·up
rounded (torch computes a half/bf16 product in fp32 and rounds it). fp32 launches with FMA contraction off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.kernel_common import launch_gated


@triton.jit
def _silu_mul_kernel(G, U, Y, stride_g, stride_u, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    t = (g * s).to(DTYPE).to(tl.float32)
    tl.store(Y + row * N + offs, (t * u).to(DTYPE), mask=m)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = gate · sigmoid(gate) · up for gate, up [..., N] of one shape and float dtype → a new contiguous y."""
    return launch_gated(_silu_mul_kernel, "SiluMul", gate, up)
