"""Triton GEMVs for decode-sized projections: a few rows of x against [N, K] weights (K contiguous), imported lazily
by runtime/executors/gemv.py (only for CUDA tensors) and by benchmarks/bench_gemv.py.

- `gemv(x, wt)`: y = x · wtᵀ, fp32 accumulation, one rounding to x's dtype at the end (as cuBLAS rounds its output).
- `gemv_silu_mul(x, w_gu)`: the gate/up projection with SiLU·mul as its epilogue, for the horizontally fused weight
  (gate's I rows, then up's I rows): y = silu(x·gᵀ)·(x·uᵀ), rounded as the unfused GEMM → trtopt.SiluMul pair
  rounds (each GEMM output to the dtype, then SiluMul's own steps, plugins/silu_mul/kernel.py). One launch instead
  of two, and the [M, 2I] intermediate is never written.

Why a GEMV beats cuBLAS here (issue 11, measured by benchmarks/bench_gemv.py, docs/benchmarks/gemv_<gpu>.json): a
decode step's projections are 8-67 MB of weights read once for one row of x, so the step is a race to have as
many bytes in flight as HBM needs (bandwidth × latency, ~30 KB per SM on an H200). cuBLAS's M = 1 kernels reach
1.4-2.7 TB/s on the 1.24B plan's Q/K/V, O and down projections, and the down projection adds a split-K reduce
kernel. Here every program owns BLOCK_N whole weight rows and reads them in K_TILES loads that the unrolled loop
issues back to back; with BLOCK_N small the grid is thousands of programs, many resident per SM, so every byte of
the weight is requested at once and no split-K (nor its reduce) is needed. Session 8's GEMVs looped over K in
256-512-wide tiles (4 KB per load): latency-bound, 1.1-3x slower than cuBLAS, removed (git show b499c6f).

Not bit-identical to cuBLAS: another accumulation order (fp32 either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2

MAX_ROWS = 4  # rows of x the kernels take: each row's product is held in registers beside the weight tile


@triton.jit
def _gemv_tile(X, W, rows, offs_k, k_ok, offs_m, m_ok, stride_xm, EVEN_K: tl.constexpr):
    """Σ_k x[m, k] · w[row, k] over one K tile → [M_PAD, BLOCK_N] in fp32."""
    if EVEN_K:
        w = tl.load(W + rows + offs_k[None, :])
    else:
        w = tl.load(W + rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
    x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
          EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, DTYPE: tl.constexpr):
    """Programs over N in blocks of BLOCK_N (N = I for SILU_MUL); the last program's rows past N are clamped to
    row N-1 (read, never stored) so that the weight loads need no row mask."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, M_PAD)
    m_ok = offs_m < M
    rows = safe_n[:, None] * stride_wn
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        rows_u = (safe_n + N)[:, None] * stride_wn
        acc_u = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for t in tl.static_range(K_TILES):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        acc += _gemv_tile(X, W, rows, offs_k, k_ok, offs_m, m_ok, stride_xm, EVEN_K)
        if SILU_MUL:
            acc_u += _gemv_tile(X, W, rows_u, offs_k, k_ok, offs_m, m_ok, stride_xm, EVEN_K)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SILU_MUL:
        g = acc.to(DTYPE).to(tl.float32)  # the GEMM's output rounding, then SiluMul's steps
        u = acc_u.to(DTYPE).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        h = (g * s).to(DTYPE).to(tl.float32)
        tl.store(out, (h * u).to(DTYPE), mask=out_mask)
    else:
        tl.store(out, acc.to(DTYPE), mask=out_mask)


def default_config(m: int, n: int, k: int, silu_mul: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for x [m, k] against n output rows (n = I for the SiLU·mul GEMV, which reads 2I
    weight rows): K in tiles of at most 2048 elements, two weight rows per program while the product tile
    (M_PAD · BLOCK_N · BLOCK_K fp32 values) stays within 8K elements (64 registers a thread at 4 warps), else one.
    At one row, two cases take other tiles, each the best of bench_gemv.py's sweep in two H200 runs
    (docs/benchmarks/gemv_h200.json, gemv_pdl_probe_h200.json): the SiLU·mul GEMV reads 1024-wide tiles with 2 warps
    (18.19/18.24 µs on the 1.24B gate/up against 18.75/18.78), and an output wider than 65536 rows (an LM head) runs
    2 warps (118.3/118.1 µs against 119.5/119.4)."""
    m_pad = next_pow2(m)
    if m_pad == 1 and silu_mul:
        return 2, min(next_pow2(k), 1024), 2
    block_k = min(next_pow2(k), 2048)
    block_n = 2 if m_pad * 2 * block_k <= 8192 else 1
    return block_n, block_k, 2 if m_pad == 1 and n > 65536 else 4


def check(x: torch.Tensor, w: torch.Tensor, what: str, rows_per_output: int = 1) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{what} needs x [M <= {MAX_ROWS}, K] and w [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in TL_DTYPES or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{what} needs x and w of one float dtype with K contiguous; got {x.dtype} {x.stride()}, "
                         f"{w.dtype} {w.stride()}")
    if w.shape[0] % rows_per_output:
        raise ValueError(f"{what} needs a weight of gate rows then as many up rows; got {w.shape[0]} rows")


def _launch(x: torch.Tensor, w: torch.Tensor, n: int, silu_mul: bool,
            config: tuple[int, int, int] | None) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_n, block_k, warps = config or default_config(m, n, k, silu_mul)
    tiles = -(-k // block_k)
    launcher.launch(_gemv, (-(-n // block_n),), x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                    M_PAD=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=tiles,
                    EVEN_K=tiles * block_k == k, SILU_MUL=silu_mul, DTYPE=TL_DTYPES[x.dtype], num_warps=warps)
    return y


def gemv(x: torch.Tensor, wt: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) · wt [N, K]ᵀ → a new [M, N] in x's dtype."""
    check(x, wt, "gemv")
    return _launch(x, wt, wt.shape[0], False, config)


def gemv_silu_mul(x: torch.Tensor, w_gu: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w_gu [2I, K] (gate rows, then up rows) → silu(x·gᵀ)·(x·uᵀ), a new [M, I]."""
    check(x, w_gu, "gemv_silu_mul", rows_per_output=2)
    return _launch(x, w_gu, w_gu.shape[0] // 2, True, config)
