"""trtopt::Rope as one Triton kernel (face 4 of docs/architecture.md §4): out = x·cos + rotate_half(x)·sin, the torch
executor's CUDA path (the executor's fx rewrite, fx_fusions.py, uses it too).

Exported Llama-family graphs apply RoPE as seven ops per tensor (two slices, neg, concat, two muls, add), i.e. seven
kernels for q and seven for k in every layer; at batch-1 decode those launches, not their bytes, cost the time. One
program here rotates one (batch, head, token) row.

The rounding is the unfused graph's, step for step: each product is rounded to x's dtype before the sum, and the sum
is rounded again (torch computes a bf16 product in fp32 and rounds it). fp32 launches with FMA contraction off, so
`x1·c1 + (−x2)·s1` is not contracted into one fused multiply-add that the unfused graph never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2, no_fp_fusion


@triton.jit
def rotate_half_rows(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """(o1, o2), the two halves of x·cos + rotate_half(x)·sin, from fp32 halves of x, cos and sin, rounded as the
    unfused graph rounds: each product to DTYPE, then the sum. PagedAttention's fused RoPE + KV write
    (paged_attention/write_kv.py) calls this too, so both kernels round alike by construction."""
    # rotate_half(x) = concat(-x2, x1)
    o1 = (x1 * c1).to(DTYPE).to(tl.float32) + (-x2 * s1).to(DTYPE).to(tl.float32)
    o2 = (x2 * c2).to(DTYPE).to(tl.float32) + (x1 * s2).to(DTYPE).to(tl.float32)
    return o1.to(DTYPE), o2.to(DTYPE)


@triton.jit
def _rope_kernel(X, Cos, Sin, Out,
                 sxb, sxh, sxt, sxd, scb, sch, sct, scd, ssb, ssh, sst, ssd, sob, soh, sot,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    x = X + b * sxb + h * sxh + t * sxt
    c = Cos + b * scb + h * sch + t * sct
    s = Sin + b * ssb + h * ssh + t * sst
    x1 = tl.load(x + offs * sxd, mask=m).to(tl.float32)
    x2 = tl.load(x + (offs + HALF) * sxd, mask=m).to(tl.float32)
    c1 = tl.load(c + offs * scd, mask=m).to(tl.float32)
    c2 = tl.load(c + (offs + HALF) * scd, mask=m).to(tl.float32)
    s1 = tl.load(s + offs * ssd, mask=m).to(tl.float32)
    s2 = tl.load(s + (offs + HALF) * ssd, mask=m).to(tl.float32)
    o1, o2 = rotate_half_rows(x1, x2, c1, c2, s1, s2, DTYPE)
    o = Out + b * sob + h * soh + t * sot
    tl.store(o + offs, o1, mask=m)
    tl.store(o + HALF + offs, o2, mask=m)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] (any strides), cos/sin broadcastable to it, all one dtype → a new contiguous [B, H, T, D]."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope_triton needs x [B, H, T, D] with an even D; got {tuple(x.shape)}")
    if not (x.dtype == cos.dtype == sin.dtype) or x.dtype not in TL_DTYPES:
        raise ValueError(f"rope_triton needs one float dtype; got x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}")
    cos, sin = cos.expand(x.shape), sin.expand(x.shape)  # views: stride 0 where they broadcast
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    B, H, T, D = x.shape
    if out.numel() == 0:
        return out
    half = D // 2
    launcher.launch(_rope_kernel, (T, H, B),
        x, cos, sin, out, *x.stride(), *cos.stride(), *sin.stride(), *out.stride()[:3],
        HALF=half, BLOCK=next_pow2(half), DTYPE=TL_DTYPES[x.dtype], num_warps=1,
        **no_fp_fusion(),
    )
    return out
