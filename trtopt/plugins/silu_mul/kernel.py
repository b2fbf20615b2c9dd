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

from trtopt.plugins.kernel_common import gated_row, gated_slice, launch_gated, launch_gated_fp8, launch_gated_xp
from trtopt.plugins.qmatmul.gemm import quantize_row_fp8
from trtopt.plugins.qmatmul.kernel_half2 import pack_x_row


@triton.jit
def silu_mul_values(g, u, DTYPE: tl.constexpr):
    """gate · sigmoid(gate) · up from fp32 loads of gate and up, rounded step by step as the unfused graph rounds
    (module docstring), in DTYPE: the math of both SiluMul kernels."""
    s = (1.0 / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    t = (g * s).to(DTYPE).to(tl.float32)
    return (t * u).to(DTYPE)


@triton.jit
def _silu_mul_kernel(G, U, Y, stride_g, stride_u, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs, m, g, u = gated_slice(G, U, row, tl.program_id(1) * BLOCK, stride_g, stride_u, N, BLOCK)
    tl.store(Y + row * N + offs, silu_mul_values(g, u, DTYPE), mask=m)


@triton.jit
def _silu_mul_fp8_kernel(G, U, Q, RS, S, stride_g, stride_u, N, MIN_SCALE, BLOCK: tl.constexpr,
                         DTYPE: tl.constexpr, DYNAMIC: tl.constexpr):
    """One whole row of y, not stored: quantized to FP8 under its dynamic per-token scale or the static one at S
    (the codes' bytes to Q [R, N], the scale to RS [R])."""
    row, offs, m, g, u = gated_row(G, U, stride_g, stride_u, N, BLOCK)
    y = silu_mul_values(g, u, DTYPE).to(tl.float32)
    quantize_row_fp8(Q + row * N + offs, RS + row, y, m, S, MIN_SCALE, DYNAMIC, DTYPE)


@triton.jit
def _silu_mul_xp_kernel(G, U, Y, XP, DOWN, stride_g, stride_u, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                         K: tl.constexpr, GROUP: tl.constexpr, X_CHUNK: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                         ASM: tl.constexpr):
    """One whole row of y in BLOCK-value slices (the plain kernel's), stored, then packed for the INT4 GEMV
    (qmatmul/kernel_half2.py `pack_x_row`: XP [R, 4, N/8], DOWN [R])."""
    row = tl.program_id(0).to(tl.int64)
    for c in tl.range(0, N, BLOCK):
        offs, m, g, u = gated_slice(G, U, row, c, stride_g, stride_u, N, BLOCK)
        tl.store(Y + row * N + offs, silu_mul_values(g, u, DTYPE), mask=m)
    pack_x_row(Y + row * N, XP + row * 4 * (K // 8), DOWN + row, K, GROUP, X_CHUNK, CHUNK_WORDS, ASM)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = gate · sigmoid(gate) · up for gate, up [..., N] of one shape and float dtype → a new contiguous y."""
    return launch_gated(_silu_mul_kernel, "SiluMul", gate, up)


def silu_mul_fp8_triton(gate: torch.Tensor, up: torch.Tensor, *, min_scale: float = 0.0,
                        act_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """y = gate · sigmoid(gate) · up quantized to FP8 per row instead of written: (codes [..., N] float8_e4m3fn, row
    scale [R, 1] fp32, y's dtype) under the static act_scale or the dynamic per-token scale, bit for bit
    `silu_mul_triton` then the activation's quantize launch, in one launch (plugins/kernel_common.py
    `launch_gated_fp8`). For a W8A8 down projection (runtime/executors/qmatmul_packing.py `fuse_norm_quantize`)."""
    return launch_gated_fp8(_silu_mul_fp8_kernel, silu_mul_triton, "SiluMul", gate, up, min_scale=min_scale,
                            act_scale=act_scale)


def silu_mul_xp_triton(gate: torch.Tensor, up: torch.Tensor, *, group: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`silu_mul_triton`'s y and, in the same launch, y packed for the INT4 GEMV of a weight of quantization group
    `group`: (y, xpack, down), or (y, None, None) where the step does not run that GEMV (plugins/kernel_common.py
    `launch_gated_xp`). For an INT4 down projection (runtime/executors/qmatmul_packing.py `fuse_norm_pack_x`)."""
    return launch_gated_xp(_silu_mul_xp_kernel, silu_mul_triton, "SiluMul", gate, up, group=group)
