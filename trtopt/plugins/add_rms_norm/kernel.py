"""AddRMSNorm as one Triton kernel (face 4 of docs/architecture.md §4): the CUDA path of the torch executor.

The unfused pair is two kernels per norm (the residual add, then trtopt::RMSNorm's one-row kernel) with the sum
written by the first and read back by the second. Here one program reads x and the residual once, writes the sum
(the next residual) and the normed row.

The arithmetic is the unfused pair's, step for step: the sum rounded to the inputs' dtype (torch adds half/bf16 in
fp32 and rounds), then exactly plugins/rms_norm/kernel.py's row (same block and warp count, so the same fp32
reduction order): y equals rms_norm_triton(x + residual) bit for bit. With an fp32 scale (Gemma's half-precision
form: Add → Cast(fp32) → RMSNorm) y equals rms_norm_triton((x + residual).float()) within fp32 rounding only (last-ulp
differences on the H200, session 8). The likely cause, not verified in the PTX: that kernel loads an fp32 row,
which Triton spreads over the threads differently from a half row, so the sum of squares is added in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, as_rows, next_pow2
from trtopt.plugins.qmatmul.gemm import quantize_row_fp8, static_scale_arg
from trtopt.plugins.qmatmul.kernel_half2 import pack_x_row
from trtopt.plugins.rms_norm.kernel import _MAX_HIDDEN, _warps, rms_row


@triton.jit
def _add_then_norm(X, R, Scale, Sum, row, offs, mask, stride_x, stride_r, N, eps, X_DTYPE: tl.constexpr,
                   OUT_DTYPE: tl.constexpr):
    """Row `row` of both AddRMSNorm kernels: the sum rounded to X_DTYPE, stored to Sum, then its normalized row
    rounded to y's dtype (the sum's, or fp32 with an fp32 scale) times the scale, returned in OUT_DTYPE."""
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(X_DTYPE)
    tl.store(Sum + row * N + offs, s, mask=mask)
    w = tl.load(Scale + offs, mask=mask, other=0.0).to(tl.float32)
    return rms_row(s.to(tl.float32), w, N, eps, OUT_DTYPE, OUT_DTYPE)


@triton.jit
def _add_rms_norm_kernel(X, R, Scale, Sum, Out, stride_x, stride_r, N, eps,
                         BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = _add_then_norm(X, R, Scale, Sum, row, offs, mask, stride_x, stride_r, N, eps, X_DTYPE, OUT_DTYPE)
    tl.store(Out + row * N + offs, y, mask=mask)


@triton.jit
def _add_rms_norm_fp8_kernel(X, R, Scale, Sum, Q, RS, S, stride_x, stride_r, N, eps, MIN_SCALE,
                             BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             DYNAMIC: tl.constexpr):
    """`_add_rms_norm_kernel` with its normed row quantized to FP8 instead of stored, under its dynamic per-token
    scale or the static one at S (the codes' bytes to Q [R, N], the scale to RS [R]); the sum is stored as there."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = _add_then_norm(X, R, Scale, Sum, row, offs, mask, stride_x, stride_r, N, eps, X_DTYPE, OUT_DTYPE)
    quantize_row_fp8(Q + row * N + offs, RS + row, y.to(tl.float32), mask, S, MIN_SCALE, DYNAMIC, OUT_DTYPE)


@triton.jit
def _add_rms_norm_xp_kernel(X, R, Scale, Sum, Out, XP, DOWN, stride_x, stride_r, N, eps, BLOCK: tl.constexpr,
                            X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                            X_CHUNK: tl.constexpr, CHUNK_WORDS: tl.constexpr, ASM: tl.constexpr):
    """`_add_rms_norm_kernel`'s sum and row, stored as there, then the row packed for the INT4 GEMV
    (qmatmul/kernel_half2.py `pack_x_row`: XP [R, 4, N/8], DOWN [R])."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = _add_then_norm(X, R, Scale, Sum, row, offs, mask, stride_x, stride_r, N, eps, X_DTYPE, OUT_DTYPE)
    tl.store(Out + row * N + offs, y, mask=mask)
    pack_x_row(Out + row * N, XP + row * 4 * (K // 8), DOWN + row, K, GROUP, X_CHUNK, CHUNK_WORDS, ASM)


def _check(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor) -> None:
    n = x.shape[-1]
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"AddRMSNorm's kernel needs x and residual of one shape and dtype; got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    if scale.dim() != 1 or scale.shape[0] != n:
        raise ValueError(f"AddRMSNorm scale must be [{n}] (x's last dim); got {tuple(scale.shape)}")
    if x.dtype not in TL_DTYPES or scale.dtype not in TL_DTYPES:
        raise ValueError(f"AddRMSNorm supports float32/float16/bfloat16; got x {x.dtype}, scale {scale.dtype}")
    if n > _MAX_HIDDEN:
        raise ValueError(f"AddRMSNorm over {n} > {_MAX_HIDDEN} elements is not supported by the one-row kernel")


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *,
                        epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum) for x and residual [..., N] of one shape and dtype, scale [N]; both outputs new and contiguous.
    y has the wider of x's and scale's dtypes (schema.py)."""
    _check(x, residual, scale)
    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out, total
    xs, rs = as_rows(x, n), as_rows(residual, n)
    block = next_pow2(n)
    launcher.launch(_add_rms_norm_kernel, (xs.shape[0],),
        xs, rs, scale.contiguous(), total, out, xs.stride(0), rs.stride(0), n, float(epsilon),
        BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype], OUT_DTYPE=TL_DTYPES[out_dtype],
        num_warps=_warps(block),
    )
    return out, total


def add_rms_norm_fp8_triton(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *, epsilon: float,
                            min_scale: float = 0.0, act_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """AddRMSNorm with y quantized to FP8 per row instead of written: (sum, codes [..., N] float8_e4m3fn, row
    scale [R, 1] fp32, y's dtype), one launch, under the static act_scale or the dynamic per-token scale. Bit for
    bit `add_rms_norm_triton` followed by the quantize launch (plugins/rms_norm/kernel.py `rms_norm_fp8_triton`
    says which and why)."""
    _check(x, residual, scale)
    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    xs, rs = as_rows(x, n), as_rows(residual, n)
    row_scale = torch.empty(xs.shape[0], 1, dtype=torch.float32, device=x.device)
    if xs.shape[0]:
        block = next_pow2(n)
        launcher.launch(_add_rms_norm_fp8_kernel, (xs.shape[0],), xs, rs, scale.contiguous(), total, codes,
                        row_scale, static_scale_arg(act_scale, row_scale), xs.stride(0), rs.stride(0), n,
                        float(epsilon), float(min_scale), BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype],
                        OUT_DTYPE=TL_DTYPES[out_dtype], DYNAMIC=act_scale is None, num_warps=_warps(block))
    return total, codes.view(torch.float8_e4m3fn), row_scale, out_dtype


def add_rms_norm_xp_triton(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *, epsilon: float,
                           group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`add_rms_norm_triton`'s (y, sum) and, in the same launch, y packed for the INT4 GEMV: (y, sum, xpack, down),
    or (y, sum, None, None) from the plain launch where the step does not run that GEMV (plugins/rms_norm/kernel.py
    `rms_norm_xp_triton` says which and why)."""
    _check(x, residual, scale)
    from trtopt.plugins.qmatmul.kernel import x_pack_outputs

    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    xs, rs = as_rows(x, n), as_rows(residual, n)
    xpack, down, pack = x_pack_outputs(xs.shape[0], n, group, out_dtype, x.device)
    if xpack is None:
        return (*add_rms_norm_triton(x, residual, scale, epsilon=epsilon), None, None)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = next_pow2(n)
    launcher.launch(_add_rms_norm_xp_kernel, (xs.shape[0],), xs, rs, scale.contiguous(), total, out, xpack, down,
                    xs.stride(0), rs.stride(0), n, float(epsilon), BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype],
                    OUT_DTYPE=TL_DTYPES[out_dtype], **pack, num_warps=_warps(block))
    return out, total, xpack, down
