"""Triton GEMVs for decode-sized projections (a few rows of x against [N, K] weights, K contiguous), imported lazily
by runtime/executors/gemv.py, only for CUDA tensors, and by benchmarks/bench_projection_layout.py.

- `gemv_triton(x, wt)`: y = x · wtᵀ. One program per BLOCK_N outputs reads its BLOCK_N weight rows once for every
  row of x (M <= 8), fp32 accumulation, one rounding to x's dtype at the end (as cuBLAS rounds its output).
- `gemv_silu_mul_triton(x, w_gu)`: the gate/up projection with SiLU·mul as its epilogue, for the horizontally fused
  weight (gate's I rows, then up's I rows): y = silu(x·gᵀ)·(x·uᵀ), rounded as the unfused GEMM → trtopt.SiluMul
  pair rounds (each GEMM output to the dtype, then SiluMul's own steps). One launch instead of two, and the [M, 2I]
  intermediate is never written.

Not bit-identical to cuBLAS (another accumulation order). Why they exist: issue 11's batch-1 profile has cuBLAS at
~1.9 TB/s on the Q/K/V and O projections and a split-K reduce kernel after every down projection; whether these do
better is benchmarks/bench_projection_layout.py's question, and `TorchExecutor(small_m_gemv=True)` (opt-in) is
gpu_e2e's `with_small_m_gemv` row. The tile sizes below are a first guess until that benchmark's autotuned choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.kernel_common import TL_DTYPES

MAX_ROWS = 8  # rows of x the kernels take (they hold every row's accumulator in registers)
# (BLOCK_N, BLOCK_K, num_warps) per kernel; bench_projection_layout.py autotunes the same kernels over a grid.
GEMV_CONFIG = (8, 512, 4)
GEMV_SILU_MUL_CONFIG = (4, 512, 4)


@triton.jit
def _gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [M_PAD, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_silu_mul(X, W, Y, M, I, K, stride_xm, stride_wn, stride_ym,
                   M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_ok = offs_n < I
    m_ok = offs_m < M
    g = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    rows_g = offs_n[:, None].to(tl.int64) * stride_wn
    rows_u = (offs_n + I)[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(W + rows_g + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        wu = tl.load(W + rows_u + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        g += tl.sum(x[:, None, :] * wg[None, :, :], axis=2)
        u += tl.sum(x[:, None, :] * wu[None, :, :], axis=2)
    g = g.to(DTYPE).to(tl.float32)  # the GEMM's output rounding, then SiluMul's (plugins/silu_mul/kernel.py)
    u = u.to(DTYPE).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    t = (g * s).to(DTYPE).to(tl.float32)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], (t * u).to(DTYPE), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[0] > MAX_ROWS:
        raise ValueError(f"{what} needs x [M <= {MAX_ROWS}, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in TL_DTYPES or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{what} needs x and w of one float dtype with K contiguous; got {x.dtype} {x.stride()}, "
                         f"{w.dtype} {w.stride()}")


def gemv_triton(x: torch.Tensor, wt: torch.Tensor, config: tuple[int, int, int] = GEMV_CONFIG) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) · wt [N, K]ᵀ → a new [M, N] in x's dtype."""
    _check(x, wt, "gemv_triton")
    M, K = x.shape
    N = wt.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_n, block_k, warps = config
    _gemv[(triton.cdiv(N, block_n),)](x, wt, y, M, N, K, x.stride(0), wt.stride(0), y.stride(0),
                                      M_PAD=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
                                      num_warps=warps)
    return y


def gemv_silu_mul_triton(x: torch.Tensor, w_gu: torch.Tensor,
                         config: tuple[int, int, int] = GEMV_SILU_MUL_CONFIG) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w_gu [2I, K] (gate rows, then up rows) → silu(x·gᵀ)·(x·uᵀ), a new [M, I]."""
    _check(x, w_gu, "gemv_silu_mul_triton")
    if w_gu.shape[0] % 2:
        raise ValueError(f"gemv_silu_mul_triton needs an even number of weight rows (gate, then up); got "
                         f"{w_gu.shape[0]}")
    M, K = x.shape
    inter = w_gu.shape[0] // 2
    y = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    if M == 0 or inter == 0:
        return y
    block_n, block_k, warps = config
    _gemv_silu_mul[(triton.cdiv(inter, block_n),)](
        x, w_gu, y, M, inter, K, x.stride(0), w_gu.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(M),
        BLOCK_N=block_n, BLOCK_K=block_k, DTYPE=TL_DTYPES[x.dtype], num_warps=warps)
    return y
