"""Triton GEMVs for decode-sized projections: a few rows of x against [N, K] weights (K contiguous), imported lazily
by runtime/executors/gemv.py (only for CUDA tensors) and by benchmarks/bench_gemv.py.

- `gemv(x, wt)`: y = x · wtᵀ, fp32 accumulation, one rounding to x's dtype at the end (as cuBLAS rounds its output).
- `gemv_silu_mul(x, w_gu)`: the gate/up projection with SiLU·mul as its epilogue, for the horizontally fused weight
  (gate's I rows, then up's I rows): y = silu(x·gᵀ)·(x·uᵀ), rounded as the unfused GEMM → trtopt.SiluMul pair
  rounds (each GEMM output to the dtype, then SiluMul's own steps, plugins/silu_mul/kernel.py). One launch instead
  of two, and the [M, 2I] intermediate is never written.
- `gemv_rope_kv(x, w_qkv, cos, sin, kv_cache, slot_mapping, ...)`: the horizontally fused Q/K/V projection of one
  token with RoPE and the KV write as its epilogue: q and k come out rotated, and k and v are written into the paged
  pool at the token's slot, bit for bit what the GEMV then PagedAttention's RoPE + KV-write kernel
  (plugins/paged_attention/kernel.py `_rope_write_kv_kernel`) give. A program owns rows d and d + D/2 of one head
  (the two halves RoPE pairs), so the rotation needs nothing from another program. One launch per layer fewer in a
  batch-1 decode step (the attention op is then told the pool is written: executors/gemv.py).

Why a GEMV beats cuBLAS here (measured by benchmarks/bench_gemv.py, docs/benchmarks/gemv_<gpu>.json): a
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

import functools
import math

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2, no_fp_fusion
from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE
from trtopt.plugins.paged_attention.write_kv import fp8_constexprs, fp8_saturate, pool_scales, value_offsets
from trtopt.plugins.rope.kernel import rotate_half_rows

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
          EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Programs over N in blocks of BLOCK_N (N = I for SILU_MUL); the last program's rows past N are clamped to
    row N-1 (read, never stored) so that the weight loads need no row mask. The output is rounded to DTYPE (the
    GEMM's rounding), then stored as OUT_DTYPE (a Cast after the GEMM, the LM head's to float32 logits)."""
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
        tl.store(out, acc.to(DTYPE).to(OUT_DTYPE), mask=out_mask)


@triton.jit
def _gemv_rope_kv(X, W, Y, Cos, Sin, Cache, SlotMapping, K, k_scale, v_scale, stride_wn, stride_cos_d,
                  stride_sin_d, stride_cb, stride_ckv, stride_ch, stride_co, stride_cd,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, POOL_BLOCK: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr,
                  DTYPE: tl.constexpr, FP8_KV: tl.constexpr = False):
    """One token's y = x · Wᵀ over the fused Q/K/V weight (rows: NUM_HEADS query heads, then NUM_KV_HEADS key heads,
    then as many value heads, 2·HALF rows each), with RoPE on q and k and the KV write as the epilogue.

    Program p owns BLOCK_P rotation pairs (rows d and d + HALF of one head); its 2·BLOCK_P rows are laid out pair by
    pair ([r1, r2, r1', r2', ...]) so one product tile serves all of them and tl.split hands back the two halves.
    Every value is rounded as the unfused pair rounds it: the GEMV's output to DTYPE, then rope/kernel.py's
    rotate_half_rows (the same function `_rope_write_kv_kernel` calls). y gets rotated q, rotated k and v; when the
    slot is >= 0 the pool gets rotated k and v at it, quantized as `_rope_write_kv_kernel` quantizes them for an FP8
    pool (FP8_KV: y / scale in fp32, saturated, rounded to nearest even by the store)."""
    pid = tl.program_id(0)
    num_pairs = (NUM_HEADS + 2 * NUM_KV_HEADS) * HALF
    # The epilogue's operands first: their loads then wait beside the weight's, not after it (the last programs'
    # epilogue is the kernel's tail).
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = p < num_pairs
    p = tl.minimum(p, num_pairs - 1)
    head_p = p // HALF
    j_p = p % HALF
    c1 = tl.load(Cos + j_p * stride_cos_d).to(tl.float32)
    c2 = tl.load(Cos + (j_p + HALF) * stride_cos_d).to(tl.float32)
    s1 = tl.load(Sin + j_p * stride_sin_d).to(tl.float32)
    s2 = tl.load(Sin + (j_p + HALF) * stride_sin_d).to(tl.float32)
    slot = tl.load(SlotMapping)

    offs = tl.arange(0, 2 * BLOCK_P)
    pair = tl.minimum(pid * BLOCK_P + offs // 2, num_pairs - 1)  # clamped: a last program's spare pairs re-read
    row = (pair // HALF) * (2 * HALF) + pair % HALF + (offs % 2) * HALF
    offs_m = tl.arange(0, 1)
    m_ok = offs_m < 1
    rows = row.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((1, 2 * BLOCK_P), dtype=tl.float32)
    for t in tl.static_range(K_TILES):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        acc += _gemv_tile(X, W, rows, offs_k, offs_k < K, offs_m, m_ok, 0, EVEN_K)
    a1, a2 = tl.split(tl.reshape(acc.to(DTYPE).to(tl.float32), (BLOCK_P, 2)))  # the GEMM output's rounding

    o1, o2 = rotate_half_rows(a1, a2, c1, c2, s1, s2, DTYPE)
    is_v = head_p >= NUM_HEADS + NUM_KV_HEADS
    y1 = tl.where(is_v, a1.to(DTYPE), o1)
    y2 = tl.where(is_v, a2.to(DTYPE), o2)
    r1 = head_p * (2 * HALF) + j_p
    tl.store(Y + r1, y1, mask=ok)
    tl.store(Y + r1 + HALF, y2, mask=ok)

    if slot >= 0:
        kv = is_v.to(tl.int64)
        hk = (head_p - NUM_HEADS - kv * NUM_KV_HEADS).to(tl.int64)
        offset = slot % POOL_BLOCK
        head = Cache + (slot // POOL_BLOCK) * stride_cb + kv * stride_ckv + hk * stride_ch
        # a key row's place in its block, or a value row's (write_kv.py `value_offsets`: an FP8 pool's are transposed)
        dst1 = head + tl.where(is_v, value_offsets(offset, j_p, stride_co, stride_cd, FP8_KV, POOL_BLOCK),
                               offset * stride_co + j_p * stride_cd)
        dst2 = head + tl.where(is_v, value_offsets(offset, j_p + HALF, stride_co, stride_cd, FP8_KV, POOL_BLOCK),
                               offset * stride_co + (j_p + HALF) * stride_cd)
        kv_ok = ok & (head_p >= NUM_HEADS)
        # (new names: a runtime branch may not give y1/y2 another type, which the interpreter does not notice)
        if FP8_KV:
            scale = tl.where(is_v, v_scale, k_scale)
            pool1 = fp8_saturate(y1, scale)
            pool2 = fp8_saturate(y2, scale)
        else:
            pool1, pool2 = y1, y2
        tl.store(dst1, pool1.to(Cache.dtype.element_ty), mask=kv_ok)
        tl.store(dst2, pool2.to(Cache.dtype.element_ty), mask=kv_ok)


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
            config: tuple[int, int, int] | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, k = x.shape
    out_dtype = out_dtype or x.dtype
    if out_dtype not in TL_DTYPES or (silu_mul and out_dtype != x.dtype):
        raise ValueError(f"gemv cannot store {out_dtype} (a float dtype; the SiLU·mul GEMV stores x's)")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if n == 0:
        return y
    block_n, block_k, warps = config or default_config(m, n, k, silu_mul)
    tiles = -(-k // block_k)
    launcher.launch(_gemv, (-(-n // block_n),), x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                    M_PAD=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=tiles,
                    EVEN_K=tiles * block_k == k, SILU_MUL=silu_mul, DTYPE=TL_DTYPES[x.dtype],
                    OUT_DTYPE=TL_DTYPES[out_dtype], num_warps=warps)
    return y


def gemv(x: torch.Tensor, wt: torch.Tensor, config: tuple[int, int, int] | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) · wt [N, K]ᵀ → a new [M, N] in x's dtype, or rounded to x's dtype and then stored
    as out_dtype (the GEMM and a Cast after it in one launch)."""
    check(x, wt, "gemv")
    return _launch(x, wt, wt.shape[0], False, config, out_dtype)


def gemv_rope_kv(x: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, config: tuple[int, int, int] | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """x [1, K] · w_qkv [(Hq + 2·Hkv)·D, K]ᵀ → a new [1, N]: rotated q, rotated k, v; and for slot_mapping[0] >= 0,
    kv_cache[slot // bs, 0|1, :, slot % bs, :] = (rotated k, v). cos and sin hold the token's row (D values, any
    leading size-1 dims), in x's dtype; kv_cache is [num_blocks, 2, Hkv, block_size, D] in x's dtype or
    float8_e4m3fn (stores k / k_scale and v / v_scale quantized, as PagedAttention's writes do). config:
    (pairs per program, BLOCK_K, num_warps); by default two pairs and K tiles of up to 2048, 4 warps.

    Compiled without FMA contraction (no_fp_fusion), so that RoPE rounds every product before the sum as the graph
    does (with contraction the H200 build was off by one unit in the last place); in fp16/bf16 the output is then
    bit for bit the plain GEMV's followed by `_rope_write_kv_kernel`. Two pairs (four weight rows) a program: 4.67 µs
    on the 1.24B plan's Q/K/V on an H200 (bf16, back to back in a CUDA graph), against 5.02 µs with one pair, 4.39 µs
    for the plain GEMV and 5.99 µs for the plain GEMV then the RoPE + KV-write kernel."""
    check(x, w_qkv, "gemv_rope_kv")
    refusal = rope_kv_refusal(x.shape, w_qkv.shape, x.dtype, cos.shape, cos.dtype, sin.shape, sin.dtype,
                              kv_cache.shape, kv_cache.dtype, slot_mapping.shape, slot_mapping.dtype,
                              num_heads, num_kv_heads, head_dim)
    if refusal is not None:
        raise ValueError(refusal)
    n, k = w_qkv.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_p, block_k, warps = config or (2, min(next_pow2(k), 2048), 4)
    if block_p != next_pow2(block_p) or block_k != next_pow2(block_k):
        raise ValueError(f"gemv_rope_kv's pairs per program and BLOCK_K must be powers of two; got {config}")
    tiles = -(-k // block_k)
    half = head_dim // 2
    launcher.launch(_gemv_rope_kv, (-(-(n // 2) // block_p),), x, w_qkv, y, cos, sin, kv_cache, slot_mapping, k,
                    *pool_scales(kv_cache, k_scale, v_scale), w_qkv.stride(0), cos.stride(-1), sin.stride(-1),
                    *kv_cache.stride(),
                    NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, POOL_BLOCK=kv_cache.shape[3],
                    BLOCK_P=block_p, BLOCK_K=block_k, K_TILES=tiles, EVEN_K=tiles * block_k == k,
                    DTYPE=TL_DTYPES[x.dtype], num_warps=warps, **fp8_constexprs(kv_cache),
                    **no_fp_fusion())
    return y


@functools.lru_cache(maxsize=256)
def rope_kv_refusal(x_shape, w_shape, dtype, cos_shape, cos_dtype, sin_shape, sin_dtype, pool_shape, pool_dtype,
                    slots_shape, slots_dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why gemv_rope_kv would refuse a call with these shapes and dtypes (beyond `check`'s), or None when it takes
    it: one row, a weight of (Hq + 2·Hkv)·D rows with D even, one token's cos/sin row in x's dtype, a pool
    [blocks, 2, Hkv, bs, D] in x's dtype or float8_e4m3fn and one int64 slot. Cached: the executor asks it before
    choosing the fused path (executors/gemv.py), and the kernel's call then finds the answer made."""
    if x_shape[0] != 1 or head_dim % 2 or w_shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        return (f"gemv_rope_kv needs one row and a weight of (num_heads + 2·num_kv_heads)·head_dim rows with an "
                f"even head_dim; got x {tuple(x_shape)}, w {tuple(w_shape)}, heads {num_heads}/{num_kv_heads}, "
                f"head_dim {head_dim}")
    for name, shape, table_dtype in (("cos", cos_shape, cos_dtype), ("sin", sin_shape, sin_dtype)):
        if math.prod(shape) != head_dim or shape[-1] != head_dim or table_dtype != dtype:
            return f"gemv_rope_kv needs {name} as one row of {head_dim} {dtype} values; got {table_dtype} {tuple(shape)}"
    if (len(pool_shape) != 5 or tuple(pool_shape[1:3]) != (2, num_kv_heads) or pool_shape[4] != head_dim
            or pool_dtype not in (dtype, FP8_POOL_DTYPE) or tuple(slots_shape) != (1,) or slots_dtype != torch.int64):
        return (f"gemv_rope_kv needs a {dtype} or {FP8_POOL_DTYPE} pool [blocks, 2, {num_kv_heads}, block_size, {head_dim}] and an int64 "
                f"slot_mapping [1]; got {pool_dtype} {tuple(pool_shape)}, {slots_dtype} {tuple(slots_shape)}")
    return None


def gemv_silu_mul(x: torch.Tensor, w_gu: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w_gu [2I, K] (gate rows, then up rows) → silu(x·gᵀ)·(x·uᵀ), a new [M, I]."""
    check(x, w_gu, "gemv_silu_mul", rows_per_output=2)
    return _launch(x, w_gu, w_gu.shape[0] // 2, True, config)
