"""GeluMul as one Triton kernel (face 4 of docs/architecture.md §4): the CUDA path of the torch executor.

The exported GeGLU is about a dozen pointwise kernels per layer (the decomposed GELU, then the Mul by up) that each
read and write the [T, I] intermediate; here one program reads gate and up once and writes y once. gate and up may
be strided views (the horizontal gate/up fusion hands them over as the two halves of one Split), as long as the last
axis is dense.

Rounding: the GELU is computed in fp32 and rounded once to the dtype, as torch's gelu (HF's module) and ONNX's Gelu
do, then ·up in fp32 rounded once, as torch rounds a half/bf16 product. So in fp16/bf16 the kernel is HF's
arithmetic, not the decomposed graph's nine roundings; in fp32 it differs from either by the last bits (exp and erf
are not torch's). The tanh form is written as g·σ(2z), the same value as 0.5·g·(1 + tanh z) without the
cancellation of 1 + tanh z for large negative z. fp32 launches with FMA contraction off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.gelu_mul.schema import KAPPA, SQRT_2, SQRT_2_OVER_PI
from trtopt.plugins.kernel_common import gated_row, gated_slice, launch_gated, launch_gated_fp8, launch_gated_xp
from trtopt.plugins.qmatmul.gemm import quantize_row_fp8
from trtopt.plugins.qmatmul.kernel_half2 import pack_x_row

_KAPPA = tl.constexpr(KAPPA)
_SQRT_2_OVER_PI = tl.constexpr(SQRT_2_OVER_PI)
_INV_SQRT_2 = tl.constexpr(1.0 / SQRT_2)


@triton.jit
def gelu_mul_values(g, u, DTYPE: tl.constexpr, TANH: tl.constexpr):
    """gelu(gate) · up from fp32 loads of gate and up, rounded as the module docstring says, in DTYPE: the math of
    both GeluMul kernels."""
    if TANH:
        z = _SQRT_2_OVER_PI * (g + _KAPPA * (g * g * g))
        e = tl.exp(-2.0 * tl.abs(z))  # σ(2z) from exp(−2|z|) ≤ 1: no overflow on either side
        a = g * (tl.where(z >= 0, 1.0, e) / (1.0 + e))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * _INV_SQRT_2))
    a = a.to(DTYPE).to(tl.float32)
    return (a * u).to(DTYPE)


@triton.jit
def _gelu_mul_kernel(G, U, Y, stride_g, stride_u, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr, TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs, m, g, u = gated_slice(G, U, row, tl.program_id(1) * BLOCK, stride_g, stride_u, N, BLOCK)
    tl.store(Y + row * N + offs, gelu_mul_values(g, u, DTYPE, TANH), mask=m)


@triton.jit
def _gelu_mul_fp8_kernel(G, U, Q, RS, S, stride_g, stride_u, N, MIN_SCALE, BLOCK: tl.constexpr,
                         DTYPE: tl.constexpr, DYNAMIC: tl.constexpr, TANH: tl.constexpr):
    """One whole row of y, not stored: quantized to FP8 under its dynamic per-token scale or the static one at S
    (the codes' bytes to Q [R, N], the scale to RS [R])."""
    row, offs, m, g, u = gated_row(G, U, stride_g, stride_u, N, BLOCK)
    y = gelu_mul_values(g, u, DTYPE, TANH).to(tl.float32)
    quantize_row_fp8(Q + row * N + offs, RS + row, y, m, S, MIN_SCALE, DYNAMIC, DTYPE)


@triton.jit
def _gelu_mul_xp_kernel(G, U, Y, XP, DOWN, stride_g, stride_u, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                         TANH: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, X_CHUNK: tl.constexpr,
                         CHUNK_WORDS: tl.constexpr, ASM: tl.constexpr):
    """One whole row of y in BLOCK-value slices (the plain kernel's), stored, then packed for the INT4 GEMV
    (qmatmul/kernel_half2.py `pack_x_row`: XP [R, 4, N/8], DOWN [R])."""
    row = tl.program_id(0).to(tl.int64)
    for c in tl.range(0, N, BLOCK):
        offs, m, g, u = gated_slice(G, U, row, c, stride_g, stride_u, N, BLOCK)
        tl.store(Y + row * N + offs, gelu_mul_values(g, u, DTYPE, TANH), mask=m)
    pack_x_row(Y + row * N, XP + row * 4 * (K // 8), DOWN + row, K, GROUP, X_CHUNK, CHUNK_WORDS, ASM)


def gelu_mul_triton(gate: torch.Tensor, up: torch.Tensor, *, tanh: int) -> torch.Tensor:
    """y = gelu(gate) · up (tanh=1: the tanh approximation) for gate, up [..., N] of one shape and float dtype → a new
    contiguous y."""
    return launch_gated(_gelu_mul_kernel, "GeluMul", gate, up, TANH=bool(tanh))


def gelu_mul_fp8_triton(gate: torch.Tensor, up: torch.Tensor, *, tanh: int, min_scale: float = 0.0,
                        act_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """y = gelu(gate) · up quantized to FP8 per row instead of written: (codes, row scale [R, 1] fp32, y's dtype)
    under the static act_scale or the dynamic per-token scale, bit for bit `gelu_mul_triton` then the activation's
    quantize launch, in one launch (plugins/kernel_common.py `launch_gated_fp8`). For a W8A8 down projection
    (runtime/executors/qmatmul_packing.py `fuse_norm_quantize`)."""
    return launch_gated_fp8(_gelu_mul_fp8_kernel, lambda g, u: gelu_mul_triton(g, u, tanh=tanh), "GeluMul", gate, up,
                            min_scale=min_scale, act_scale=act_scale, TANH=bool(tanh))


def gelu_mul_xp_triton(gate: torch.Tensor, up: torch.Tensor, *, tanh: int, group: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`gelu_mul_triton`'s y and, in the same launch, y packed for the INT4 GEMV (plugins/kernel_common.py
    `launch_gated_xp`): (y, xpack, down), or (y, None, None). For an INT4 down projection."""
    return launch_gated_xp(_gelu_mul_xp_kernel, lambda g, u: gelu_mul_triton(g, u, tanh=tanh), "GeluMul", gate, up,
                           group=group, TANH=bool(tanh))
