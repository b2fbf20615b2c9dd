"""RMSNorm as one Triton kernel (face 4 of docs/architecture.md §4): the CUDA path of the torch executor.

The torch reference spends five to seven kernels per norm (cast, square, mean, rsqrt, two multiplies, cast); at
batch-1 decode, where every kernel moves a few kilobytes, those launches rather than the bytes set the time. Here
one program normalises one row: it reads x once, reduces in fp32 and writes the output once.

The arithmetic is the reference's, step for step: fp32 mean of squares, x32 * rsqrt(mean + eps) rounded to x's
dtype, then the product with `scale` in the promoted dtype of (scale, x) (what torch does for `scale * y`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, as_rows, next_pow2
from trtopt.plugins.qmatmul.gemm import quantize_row_fp8, static_scale_arg
from trtopt.plugins.qmatmul.kernel_half2 import pack_x_row


@triton.jit
def rms_row(x, s, N, eps, ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One row's RMSNorm in fp32 (x and the scale s loaded as fp32, zeros past N): x · rsqrt(mean(x²) + eps)
    rounded to ROUND_DTYPE, times s, rounded to OUT_DTYPE. The row math of every RMSNorm kernel (this module's, its
    FP8 form, add_rms_norm's), so that each gives the others' values bit for bit at the same BLOCK and warps."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * rstd).to(ROUND_DTYPE).to(tl.float32)
    return (s * y).to(OUT_DTYPE)


@triton.jit
def _normed_row(X, Scale, stride_x, N, eps, BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """This program's row of x (and the scale) loaded as fp32, zeros past N, through `rms_row`: (row, offsets,
    mask, y). The row of every RMSNorm kernel below."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Scale + offs, mask=mask, other=0.0).to(tl.float32)
    return row, offs, mask, rms_row(x, s, N, eps, X_DTYPE, OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(X, Scale, Out, stride_x, stride_o, N, eps,
                     BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    # y rounded to x's dtype, as the reference's .to(x.dtype), then the scale's product in the promoted dtype
    row, offs, mask, y = _normed_row(X, Scale, stride_x, N, eps, BLOCK, X_DTYPE, OUT_DTYPE)
    tl.store(Out + row * stride_o + offs, y, mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(X, Scale, Q, RS, S, stride_x, N, eps, MIN_SCALE,
                         BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, DYNAMIC: tl.constexpr):
    """`_rms_norm_kernel`'s row, not stored: quantized to FP8 instead, under its dynamic per-token scale or the
    static one at S (the codes' bytes to Q [R, N], the scale to RS [R])."""
    row, offs, mask, y = _normed_row(X, Scale, stride_x, N, eps, BLOCK, X_DTYPE, OUT_DTYPE)
    quantize_row_fp8(Q + row * N + offs, RS + row, y.to(tl.float32), mask, S, MIN_SCALE, DYNAMIC, OUT_DTYPE)


@triton.jit
def _rms_norm_xp_kernel(X, Scale, Out, XP, DOWN, stride_x, N, eps, BLOCK: tl.constexpr, X_DTYPE: tl.constexpr,
                        OUT_DTYPE: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, X_CHUNK: tl.constexpr,
                        CHUNK_WORDS: tl.constexpr, ASM: tl.constexpr):
    """`_rms_norm_kernel`'s row, stored as there, then packed for the INT4 GEMV (qmatmul/kernel_half2.py
    `pack_x_row`: XP [R, 4, N/8], DOWN [R])."""
    row, offs, mask, y = _normed_row(X, Scale, stride_x, N, eps, BLOCK, X_DTYPE, OUT_DTYPE)
    tl.store(Out + row * N + offs, y, mask=mask)
    pack_x_row(Out + row * N, XP + row * 4 * (K // 8), DOWN + row, K, GROUP, X_CHUNK, CHUNK_WORDS, ASM)


_MAX_HIDDEN = 65536


def _check(x: torch.Tensor, scale: torch.Tensor) -> None:
    n = x.shape[-1]
    if scale.dim() != 1 or scale.shape[0] != n:
        raise ValueError(f"RMSNorm scale must be [{n}] (x's last dim); got {tuple(scale.shape)}")
    if x.dtype not in TL_DTYPES or scale.dtype not in TL_DTYPES:
        raise ValueError(f"RMSNorm supports float32/float16/bfloat16; got x {x.dtype}, scale {scale.dtype}")
    if x.device != scale.device:
        raise ValueError(f"x is on {x.device} but scale on {scale.device}")
    if n > _MAX_HIDDEN:
        raise ValueError(f"RMSNorm over {n} > {_MAX_HIDDEN} elements is not supported by the one-row kernel")


def _warps(block: int) -> int:
    return 4 if block <= 4096 else 8


def rms_norm_triton(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float) -> torch.Tensor:
    """out[..., :] = scale * (x * rsqrt(mean(x², -1) + eps)).to(x.dtype), for x [..., N] and scale [N]."""
    _check(x, scale)
    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    rows = as_rows(x, n)
    scale = scale.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    block = next_pow2(n)
    launcher.launch(_rms_norm_kernel, (rows.shape[0],),
        rows, scale, out, rows.stride(0), n, n, float(epsilon),
        BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype], OUT_DTYPE=TL_DTYPES[out_dtype],
        num_warps=_warps(block),
    )
    return out


def rms_norm_fp8_triton(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float, min_scale: float = 0.0,
                        act_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """RMSNorm's output quantized to FP8 per row, in one launch, without writing the output itself: (codes [..., N]
    float8_e4m3fn, row scale [R, 1] fp32, the output's dtype), under the static per-tensor act_scale, or without it
    the dynamic per-token scale. Bit for bit `rms_norm_triton` followed by plugins/qmatmul/gemm.py
    `quantize_fp8_rows(y, act_scale)` (dynamic: `quantize_fp8_rows(y, None, DynamicScale(y.dtype, min_scale))`):
    the same row math
    (`rms_row`, same block and warps) and the same quantization. For a W8A8 projection whose input is the norm's
    (runtime/executors/qmatmul_packing.py `fuse_norm_quantize`): one launch instead of two, and the bf16 row is
    neither written nor read back."""
    _check(x, scale)
    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    rows = as_rows(x, n)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    row_scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = next_pow2(n)
        launcher.launch(_rms_norm_fp8_kernel, (rows.shape[0],), rows, scale.contiguous(), codes, row_scale,
                        static_scale_arg(act_scale, row_scale), rows.stride(0), n, float(epsilon), float(min_scale),
                        BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype], OUT_DTYPE=TL_DTYPES[out_dtype],
                        DYNAMIC=act_scale is None, num_warps=_warps(block))
    return codes.view(torch.float8_e4m3fn), row_scale, out_dtype


def rms_norm_xp_triton(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float, group: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`rms_norm_triton`'s y and, in the same launch, y packed for the INT4 GEMV of a weight of quantization group
    `group` (plugins/qmatmul/kernel.py `qgemv_xp`): (y, xpack, down), the words `pack_x_half2(y)` would write, bit
    for bit. A step that does not run that GEMV (more rows, an fp32 y: kernel.py `x_pack_outputs`) gets the plain
    launch and (y, None, None). For an INT4 projection whose input is the norm's (runtime/executors/
    qmatmul_packing.py `fuse_norm_pack_x`): one launch a projection less."""
    _check(x, scale)
    from trtopt.plugins.qmatmul.kernel import x_pack_outputs

    n = x.shape[-1]
    out_dtype = torch.promote_types(scale.dtype, x.dtype)
    rows = as_rows(x, n)
    xpack, down, pack = x_pack_outputs(rows.shape[0], n, group, out_dtype, x.device)
    if xpack is None:
        return rms_norm_triton(x, scale, epsilon=epsilon), None, None
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = next_pow2(n)
    launcher.launch(_rms_norm_xp_kernel, (rows.shape[0],), rows, scale.contiguous(), out, xpack, down,
                    rows.stride(0), n, float(epsilon), BLOCK=block, X_DTYPE=TL_DTYPES[x.dtype],
                    OUT_DTYPE=TL_DTYPES[out_dtype], **pack, num_warps=_warps(block))
    return out, xpack, down
