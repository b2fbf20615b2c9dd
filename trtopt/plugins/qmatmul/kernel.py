"""QMatMul as a Triton GEMV for small M (face 4 of docs/architecture.md §4): the CUDA path of the torch executor
for decode-sized steps (M <= MAX_ROWS rows of x); larger steps run the reference (dequantize once, one GEMM).

Each program owns BLOCK_N output columns and walks K in BLOCK_K steps: it loads the quantized weight tile (FP8 as
float8e4nv, INT4/UINT4 as the executor holds them, one int8/uint8 per value), dequantizes it in registers with its
per-column or per-block scale and zero point, and accumulates x_tile @ w_tile in fp32 (IEEE, no TF32). The weight
is read once, quantized: that is what makes decode faster than a float GEMV. The activation's FP8 Q/DQ (static or
dynamic) is elementwise on the small x and runs first, in torch (the reference's fake_quantize_fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.kernel_common import next_pow2
from trtopt.plugins.qmatmul.reference import fake_quantize_fp8, qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_NONE

MAX_ROWS = 16  # tl.dot's smallest M; more rows run the reference's one GEMM
BLOCK_N = 64
BLOCK_K = 32  # cut to G when G < 32; a G that it does not divide (or G < 16, below tl.dot's K) runs the reference


@triton.jit
def _qmatmul_kernel(X, W, S, Z, Y, M, N, K, stride_xm, stride_wk, stride_sg, stride_ym, GROUP,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKED: tl.constexpr,
                    FP8: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)  # FP8's zero point is 0 by the rule (and may be written -0)
    if not BLOCKED:  # per output channel: one scale (and zero point) row for all of K
        scale = tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if not FP8:
            zero = tl.load(Z + offs_n, mask=mask_n, other=0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        w_ptr = W + offs_k[:, None] * stride_wk + offs_n[None, :]
        w_mask = mask_k[:, None] & mask_n[None, :]
        if FP8:
            w = tl.load(w_ptr, mask=w_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = tl.load(w_ptr, mask=w_mask, other=0).to(tl.float32)
        if BLOCKED:  # BLOCK_K divides GROUP: the whole tile lies in one block row
            g = k0 // GROUP
            scale = tl.load(S + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if not FP8:
                zero = tl.load(Z + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.float32)
        w = (w - zero[None, :]) * scale[None, :]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def qmatmul_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   act_scale: torch.Tensor, act_zero_point: torch.Tensor | None = None,
                   act_quantized: torch.Tensor | None = None, act_static: torch.Tensor | None = None, *,
                   axis: int = 1, block_size: int = 0, act_mode: int = ACT_NONE, act_block_size: int = 0,
                   weight_dtype: int = 0) -> torch.Tensor:
    """QMatMul for x [..., K] with at most MAX_ROWS rows; the reference otherwise (same arguments, same result up to
    fp32 summation order)."""
    k, n = w_q.shape
    rows = x.numel() // k if k else 0
    fits = (0 < rows <= MAX_ROWS and x.shape[-1] == k and w_q.is_contiguous() and w_q.dim() == 2
            and (block_size == 0 or (block_size >= 16 and block_size % min(BLOCK_K, block_size) == 0)))
    if not fits:
        return qmatmul_ref(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, axis=axis,
                           block_size=block_size, act_mode=act_mode)
    assert w_scale.shape == ((n,) if block_size == 0 else (k // block_size, n)), (w_scale.shape, w_q.shape)
    xf = x.reshape(rows, k).float()
    if act_mode != ACT_NONE:
        xf = fake_quantize_fp8(xf, act_scale.float().reshape(-1, 1) if act_scale.dim() else act_scale.float())
    xf = xf.contiguous()
    fp8 = w_q.dtype == torch.float8_e4m3fn
    w = w_q.view(torch.uint8) if fp8 else w_q
    z = w_zero_point.view(torch.uint8) if w_zero_point.dtype == torch.float8_e4m3fn else w_zero_point
    scale, zero = w_scale.contiguous(), z.contiguous()
    y = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    block_k = min(BLOCK_K, block_size) if block_size else BLOCK_K
    _qmatmul_kernel[(triton.cdiv(n, BLOCK_N),)](
        xf, w, scale, zero, y, rows, n, k, xf.stride(0), w.stride(0), scale.stride(0) if block_size else 0,
        y.stride(0), block_size or 1, BLOCK_M=max(16, next_pow2(rows)), BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        BLOCKED=bool(block_size), FP8=fp8)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
