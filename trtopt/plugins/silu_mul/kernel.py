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

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, as_rows, launch_gated, no_fp_fusion
from trtopt.plugins.qmatmul.gemm import (QUANTIZE_BLOCK_K, DynamicScale, quantize_fp8_rows, quantize_launch_config,
                                         quantize_row_fp8)


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
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * N + offs, silu_mul_values(g, u, DTYPE), mask=m)


@triton.jit
def _silu_mul_fp8_kernel(G, U, Q, RS, stride_g, stride_u, N, MIN_SCALE, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    """One whole row of y, not stored: quantized to FP8 under its dynamic per-token scale (the codes' bytes to Q
    [R, N], the scale to RS [R])."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    quantize_row_fp8(Q + row * N + offs, RS + row, silu_mul_values(g, u, DTYPE).to(tl.float32), m, MIN_SCALE, DTYPE)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = gate · sigmoid(gate) · up for gate, up [..., N] of one shape and float dtype → a new contiguous y."""
    return launch_gated(_silu_mul_kernel, "SiluMul", gate, up)


def silu_mul_fp8_triton(gate: torch.Tensor, up: torch.Tensor, *,
                        min_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """y = gate · sigmoid(gate) · up quantized to FP8 per row instead of written: (codes [..., N] float8_e4m3fn, row
    scale [R, 1] fp32, y's dtype). Bit for bit `silu_mul_triton` followed by plugins/qmatmul/gemm.py
    `quantize_fp8_rows(y, None, DynamicScale(y.dtype, min_scale))`, in one launch of a program a row (the quantize
    launch's shape: plugins/qmatmul/gemm.py `quantize_launch_config`) for rows of up to QUANTIZE_BLOCK_K values;
    longer rows run those two launches. For a W8A8 down projection (runtime/executors/qmatmul_packing.py
    `fuse_norm_quantize`)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in TL_DTYPES:
        raise ValueError(f"SiluMul needs gate and up of one shape and float dtype; got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    n = gate.shape[-1]
    if n > QUANTIZE_BLOCK_K:
        y = silu_mul_triton(gate, up)
        codes, row_scale = quantize_fp8_rows(y.reshape(-1, n), None, DynamicScale(y.dtype, min_scale))
        return codes.reshape(y.shape), row_scale, y.dtype
    g, u = as_rows(gate, n), as_rows(up, n)
    codes = torch.empty(gate.shape, dtype=torch.uint8, device=gate.device)
    row_scale = torch.empty(g.shape[0], 1, dtype=torch.float32, device=gate.device)
    if g.shape[0] and n:
        block, warps = quantize_launch_config(n)
        launcher.launch(_silu_mul_fp8_kernel, (g.shape[0],), g, u, codes, row_scale, g.stride(0), u.stride(0), n,
                        float(min_scale), BLOCK=block, DTYPE=TL_DTYPES[gate.dtype], num_warps=warps,
                        **no_fp_fusion())
    return codes.view(torch.float8_e4m3fn), row_scale, gate.dtype
