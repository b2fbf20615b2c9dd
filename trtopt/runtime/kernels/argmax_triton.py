"""The two Triton launches of argmax.greedy_argmax (imported lazily, only for CUDA logits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import next_pow2

CHUNK = 4096  # values per program of the first launch


@triton.jit
def _order_key(x):
    """fp32 → int64 key whose order is the float order; NaN above +inf (torch.argmax's rule), −0 equal to +0."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    return tl.where(x != x, 0x100000000, key)


@triton.jit
def _argmax_pieces(X, Keys, Idx, V, stride_x, num_pieces, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    offs = piece * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _order_key(x), -1)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, 2**31 - 1), axis=0)
    tl.store(Keys + row * num_pieces + piece, best)
    tl.store(Idx + row * num_pieces + piece, first)


@triton.jit
def _argmax_rows(Keys, Idx, Out, num_pieces, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < num_pieces
    key = tl.load(Keys + row * num_pieces + offs, mask=ok, other=-2)
    idx = tl.load(Idx + row * num_pieces + offs, mask=ok, other=2**31 - 1)
    best = tl.max(key, axis=0)
    tl.store(Out + row, tl.min(tl.where(key == best, idx, 2**31 - 1), axis=0).to(tl.int64))


def argmax_triton(logits: torch.Tensor, *, chunk: int = CHUNK, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float logits (unit last stride) → [N] int64, bit for bit `logits.argmax(-1)`; two launches. out: a
    contiguous int64 [N] tensor on the logits' device to write into (returned), else a new one."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not logits.is_floating_point():
        raise ValueError(f"argmax_triton needs [N, V] float logits with a unit last stride; got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    N, V = logits.shape
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=logits.device)
    elif out.shape != (N,) or out.dtype != torch.int64 or out.device != logits.device or not out.is_contiguous():
        raise ValueError(f"argmax_triton's out must be a contiguous int64 [{N}] tensor on {logits.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if N == 0 or V == 0:
        return logits.argmax(dim=-1) if V == 0 else out  # torch raises for V == 0: keep its error
    num_pieces = -(-V // chunk)
    keys = torch.empty(N, num_pieces, dtype=torch.int64, device=logits.device)
    idx = torch.empty(N, num_pieces, dtype=torch.int32, device=logits.device)
    launcher.launch(_argmax_pieces, (N, num_pieces), logits, keys, idx, V, logits.stride(0), num_pieces,
                    CHUNK=chunk, num_warps=8 if chunk >= 4096 else 4)
    launcher.launch(_argmax_rows, (N,), keys, idx, out, num_pieces,
                    BLOCK=max(2, next_pow2(num_pieces)), num_warps=1)
    return out
