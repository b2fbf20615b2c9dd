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


@triton.jit
def _rms_norm_kernel(X, Scale, Out, stride_x, stride_o, N, eps,
                     BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * rstd).to(X_DTYPE).to(tl.float32)  # rounded to x's dtype, as the reference's .to(x.dtype)
    s = tl.load(Scale + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (s * y).to(OUT_DTYPE), mask=mask)


_MAX_HIDDEN = 65536


def rms_norm_triton(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float) -> torch.Tensor:
    """out[..., :] = scale * (x * rsqrt(mean(x², -1) + eps)).to(x.dtype), for x [..., N] and scale [N]."""
    n = x.shape[-1]
    if scale.dim() != 1 or scale.shape[0] != n:
        raise ValueError(f"RMSNorm scale must be [{n}] (x's last dim); got {tuple(scale.shape)}")
    if x.dtype not in TL_DTYPES or scale.dtype not in TL_DTYPES:
        raise ValueError(f"RMSNorm supports float32/float16/bfloat16; got x {x.dtype}, scale {scale.dtype}")
    if x.device != scale.device:
        raise ValueError(f"x is on {x.device} but scale on {scale.device}")
    if n > _MAX_HIDDEN:
        raise ValueError(f"RMSNorm over {n} > {_MAX_HIDDEN} elements is not supported by the one-row kernel")
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
        num_warps=4 if block <= 4096 else 8,
    )
    return out
