"""QMatMul as Triton decode GEMVs (face 4 of docs/architecture.md §4), and the CUDA path's dispatch by step size
(`qmatmul_packed`): steps of up to GEMV_MAX_ROWS rows of x run the GEMV below; larger ones (prefill, large decode
batches) a tensor-core GEMM over the same packed weight (gemm.py: FP8 W8A8 through torch._scaled_mm from
SCALED_MM_MIN_ROWS rows, else a Triton tl.dot GEMM dequantizing in registers, on the FP8 tensor cores for W8A8);
weights no GEMM takes (INT4 groups below 16) dequantize once and run one fp32 GEMM (the reference's math).

Why: a batch-1 decode step is bound by the bytes of its weights, so a quantized projection is only faster than the
bf16 one if the kernel streams the *quantized* bytes once, at the rate runtime/kernels/gemv_triton.py streams bf16
(its design is mirrored here), and dequantizes in registers. The weights are repacked once at load (packing.py):
FP8 [N, K] float8e4nv bytes, INT4/UINT4 [N, K/8] int32 words of eight nibbles (half the bytes of one int8 a value,
what the first version of this kernel read), scales [N] or [N, K/G] in the plan's dtype.

- Each program owns BLOCK_N whole weight columns (rows of the packed [N, ·] tensor) and reads them in K_TILES
  unrolled tiles, issued back to back; with small BLOCK_N the grid is thousands of programs, so every byte of the
  weight is requested at once (gemv_triton's argument; no split-K, no reduce kernel).
- The weight tile is dequantized once and reused for every row of x the program owns (a static loop over the
  rows, each reduced before the next, so the registers held do not grow with the rows). Steps of more than
  ROWS_PER_PROGRAM rows split their rows over adjacent programs of the same columns, which read the tile from L2.
- FP8: y = s[n] · Σ_k x[k] · w[n, k], fp32 (the per-column scale applied once, after the sum).
- INT4/UINT4: a nibble u becomes an exact fp32 in two integer ops and one add, without an int→float conversion:
  ((word >> 4p) & 15) | 0x4B000000, read as fp32, is 2²³ + u, and subtracting 2²³ + z' (z' the group's
  offset-binary zero point) leaves u − z' = q − z exactly. Per group, s[g, n] · Σ_{k∈g} x[k] · (q − z); the
  nibble-plane layout puts each of a word's eight values against its own contiguous run of x. (One byte a load
  unit, split into two nibbles, measured ~7.7 instructions a value in the SASS of an sm_90a build, more than HBM
  leaves time for at one row; the planes take ~4.)

A second INT4/UINT4 GEMV, kernel_half2.py (`qgemv(..., variant="half2")`, INT4_GEMV_VARIANT picks the default),
reads the same packed weights for bf16/fp16 x in packed half2 arithmetic (PTX through tl.inline_asm_elementwise):
~3 SASS instructions a value instead of ~7.6, with fp16 products and four-term sums (~2^-12 of a word's sum).

The dequantized values are the reference's ((q − z) · s in fp32, reference.py), accumulated in fp32; the scale is
applied to each group's (FP8: column's) sum instead of to each value, which reorders the rounding only (the result
equals `qmatmul_ref` to fp32 rounding, tests/plugins/test_qmatmul_kernel.py). The output is rounded to x's dtype, as
the reference rounds it. The activation's FP8 Q/DQ (static or dynamic) is elementwise on the small x and runs first,
in one Triton launch (gemm.py `fake_quantize_fp8_rows`: reference.py `fake_quantize_fp8`'s values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2
from trtopt.plugins.qmatmul.gemm import (DEQUANT_MM_MIN_ROWS, SCALED_MM_MIN_ROWS, DynamicScale, dequant_mm,
                                         fake_quantize_fp8_rows, fp8_scaled_mm, gemm_supported, qgemm,
                                         quantize_fp8_rows, scaled_mm_supported)
from trtopt.plugins.qmatmul.kernel_half2 import (_pack_x_half2, _qgemv_int4_half2, _qgemv_int4_xp, default_config_half2,
                                                 default_config_xp, load_int4_tile, program_columns,
                                                 x_chunk)
from trtopt.plugins.qmatmul.packing import PackedQWeight, dequantize_packed, pack_weight, packable
from trtopt.plugins.qmatmul.reference import fake_quantize_fp8, qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_NONE

MAX_ROWS = 16  # rows of x `qgemv` takes at most (its chunking: ROWS_PER_PROGRAM rows a program)
# Rows of x up to which a step runs the GEMV, more the GEMM (gemm.py). On the H100 the GEMV lost to bf16's cuBLAS
# from 4 rows on (0.90x FP8, 0.63x INT4: docs/benchmarks/quant_e2e_h100.json), each extra row costing ~30% of its
# one-row time, while a tl.dot GEMM streams the weight once for up to 16 rows; benchmarks/bench_qmatmul.py times
# both at 1, 2, 4, 8 and 16 rows and reports the crossover this constant should follow: on an H200
# (docs/benchmarks/qmatmul_nvidia_h200.json) the GEMM beat the GEMV from 4 rows on every 8B projection, for FP8 and
# INT4 alike, and lost at 2 (down: FP8 GEMV 34.0 us against the GEMM's 48.4).
GEMV_MAX_ROWS = 2
# INT4/UINT4 weight-only steps on bf16/fp16 x run the "half2_xp" GEMV up to this many rows (`gemv_max_rows`): on an
# H200 at 4 rows its best config took Llama-8B's four projections in 138.7 µs (bf16 cuBLAS 119.6), where the Triton
# GEMM's default took 211.4 (bf16 118.2): docs/benchmarks/probe_qgemv_xp_m4_h200.json against
# probe_gemm_sweep_m4_h200.json, two runs on one GPU kind. At 8 rows the GEMV's best is 260 µs (bf16 120.6;
# probe_qgemv_xp_m8_h200.json) and the GEMM there is untimed, so the limit stays at the 4 rows measured.
XP_GEMV_MAX_ROWS = 4
ROWS_PER_PROGRAM = 8  # rows of x one program multiplies its dequantized tile with
TILE_VALUES = 8192  # weight values one program dequantizes per K tile (64 fp32 registers a thread at 4 warps)
MAX_TILE_K = 4096  # at most this many K values of one column per tile
# The INT4/UINT4 GEMV `qgemv` runs when not told (variant=None): "fp32" (`_qgemv_int4` below), "half2"
# (kernel_half2.py: packed half2 math converting x in the GEMV) or "half2_xp" (the same math after a launch packs x
# into half2 words once; bf16/fp16 x only, fp32 x always runs "fp32"). On an H200 "half2" took Llama-8B's four
# projections at one row 1.3-1.6x faster than bf16 where "fp32" was 0.9-1.2x (docs/benchmarks/
# qmatmul_int4_gemv_h200.json), and "half2_xp" took them from 74.0 to 54.2 us a layer (bf16 118.2;
# benchmarks/probe_qgemv.py --xp-sweep, docs/benchmarks/probe_qgemv_xp2_m1_h200.json): 8B batch 1 1.32x -> 1.98x.
INT4_GEMV_VARIANT = "half2_xp"
INT4_GEMV_VARIANTS = ("fp32", "half2", "half2_xp")
XP_CHUNK_WORDS = 256  # word positions of x one program of `_pack_x_half2` packs


@triton.jit
def _fp8_tile(X, W, t, acc, acc_tile, row0, M, K, safe_n, offs_r, stride_xm, stride_wn, ROWS: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X_FP8: tl.constexpr):
    """K tile t of `_qgemv_fp8`: (acc, acc_tile) after its products."""
    offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w_ptr = W + safe_n[:, None] * stride_wn + offs_k[None, :]
    if EVEN_K:
        w = tl.load(w_ptr)
    else:
        w = tl.load(w_ptr, mask=k_ok[None, :], other=0)
    w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, BLOCK_K]
    for r in tl.static_range(ROWS):
        k_end = tl.where(row0 + r < M, K, 0)  # a row past M reads nothing
        x = tl.load(X + (row0 + r) * stride_xm + offs_k[None, :], mask=offs_k[None, :] < k_end, other=0)
        if X_FP8:
            x = x.to(tl.float8e4nv, bitcast=True)
        x = x.to(tl.float32)
        if ROWS == 1:
            acc_tile += w * x
        else:
            acc += tl.where(offs_r[:, None] == r, tl.sum(w * x, axis=1)[None, :], 0.0)
    return acc, acc_tile


@triton.jit
def _qgemv_fp8(X, W, S, XS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
               ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr, X_FP8: tl.constexpr,
               OUT_DTYPE: tl.constexpr, STAGES: tl.constexpr):
    """Program p: columns (p // CHUNKS)·BLOCK_N.., rows (p % CHUNKS)·ROWS.. of x. Columns past N are clamped to
    N − 1 (read, never stored), so the weight loads need no column mask. One row: products accumulate in a
    tile-shaped fp32 accumulator, reduced once after the last tile (one FMA a value, no per-tile shuffles).
    X_FP8: x holds an FP8-quantized activation's codes (uint8) and XS [M] fp32 its row scales, applied with the
    column scale (code · weight products are exact in fp32: 4 + 4 significant bits). STAGES 0: the K tiles
    unrolled; else a run-time loop software-pipelined STAGES deep."""
    row0, offs_n, n_ok, safe_n = program_columns(N, CHUNKS, ROWS, BLOCK_N)
    offs_r = tl.arange(0, ROWS_PAD)
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    acc_tile = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if STAGES == 0:
        for t in tl.static_range(K_TILES):
            acc, acc_tile = _fp8_tile(X, W, t, acc, acc_tile, row0, M, K, safe_n, offs_r, stride_xm, stride_wn, ROWS,
                                      BLOCK_K, EVEN_K, X_FP8)
    else:
        for t in tl.range(K_TILES, num_stages=STAGES):
            acc, acc_tile = _fp8_tile(X, W, t, acc, acc_tile, row0, M, K, safe_n, offs_r, stride_xm, stride_wn, ROWS,
                                      BLOCK_K, EVEN_K, X_FP8)
    if ROWS == 1:
        acc = tl.sum(acc_tile, axis=1)[None, :]
    scale = tl.load(S + safe_n).to(tl.float32)
    rows = row0 + offs_r
    # Only this program's ROWS rows: the padding rows ROWS..ROWS_PAD hold zeros and are the next chunk's rows
    # (m = 12: rows 6, 7), which a racing store would overwrite on a GPU.
    row_ok = (offs_r < ROWS) & (rows < M)
    if X_FP8:
        acc = acc * tl.load(XS + rows, mask=row_ok, other=0.0)[:, None]
    out = Y + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, (acc * scale[None, :]).to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _qgemv_int4(X, W, S, Z, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym,
                ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP: tl.constexpr, GROUPS: tl.constexpr, TILE_GROUPS: tl.constexpr, K_TILES: tl.constexpr,
                ZERO: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """As _qgemv_fp8, over the nibble planes (packing.py): a tile is TILE_GROUPS whole groups of BLOCK_N columns,
    [BLOCK_N, TILE_GROUPS, GROUP/8] int32 words, eight planes each. ZERO >= 0: every group's z' is ZERO (no
    zero-point loads); ZERO < 0: z' from Z [N, GROUPS] (stride_sn, like S). One row: a tile-shaped accumulator of
    scale · Σ_planes, reduced once at the end; more rows: each row's tile reduced per tile."""
    WORDS: tl.constexpr = GROUP // 8
    row0, offs_n, n_ok, safe_n = program_columns(N, CHUNKS, ROWS, BLOCK_N)
    offs_j = tl.arange(0, WORDS)
    offs_r = tl.arange(0, ROWS_PAD)
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    acc_tile = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    for t in tl.static_range(K_TILES):
        b, s, offs_g, g_ok, s_off = load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t, TILE_GROUPS, GROUPS,
                                                   WORDS)
        b = b.to(tl.uint32, bitcast=True)  # logical shifts: plane 7 needs no sign handling
        if ZERO >= 0:
            off = tl.full((BLOCK_N, TILE_GROUPS, 1), 8388608.0 + ZERO, tl.float32)
        else:
            off = (tl.load(Z + s_off, mask=g_ok[None, :], other=0).to(tl.float32) + 8388608.0)[:, :, None]
        x_off = (offs_g[:, None] * GROUP + offs_j[None, :])[None, :, :]  # [1, TILE_GROUPS, WORDS]: plane 0's K
        for r in tl.static_range(ROWS):
            x_ok = offs_g[None, :, None] < tl.where(row0 + r < M, GROUPS, 0)  # a row past M reads nothing
            x_row = X + (row0 + r) * stride_xm + x_off
            dot = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
            for p in tl.static_range(8):
                # 2²³ + u as fp32, minus 2²³ + z': q − z, exact.
                v = (((b >> (4 * p)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - off
                x = tl.load(x_row + p * WORDS, mask=x_ok, other=0.0).to(tl.float32)
                dot += v * x
            if ROWS == 1:
                acc_tile += dot * s[:, :, None]
            else:
                part = tl.sum(tl.sum(dot, axis=2) * s, axis=1)
                acc += tl.where(offs_r[:, None] == r, part[None, :], 0.0)
    if ROWS == 1:
        acc = tl.sum(tl.sum(acc_tile, axis=2), axis=1)[None, :]
    rows = row0 + offs_r
    row_ok = (offs_r < ROWS) & (rows < M)  # this program's rows only, as in _qgemv_fp8
    out = Y + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


def _tile_k(k: int) -> int:
    """K values of one column per tile: the largest power of two <= MAX_TILE_K that divides K (whole tiles, no K
    mask), unless that is below 512 (then the power of two covering K, capped, with a masked last tile)."""
    tile = min(next_pow2(k), MAX_TILE_K)
    while tile > 512 and k % tile:
        tile //= 2
    return tile if k % tile == 0 else min(next_pow2(k), MAX_TILE_K)


FP8_ONE_ROW_TILE_K = 512  # K values a tile of the one-row FP8 GEMV, at most (`default_config`)


def default_config(rows: int, n: int, k: int, group: int = 0, x_bytes: int = 2) -> tuple[int, ...]:
    """(BLOCK_N, K values per tile, num_warps[, stages]) for x [rows, k] (x_bytes a value) against an [n, k]
    quantized weight (group 0: FP8).

    FP8 at one row of 16-bit x or FP8 codes: 4 columns a program, 2 warps, K tiles of at most FP8_ONE_ROW_TILE_K
    values (`_tile_k`'s whole tiles where K allows) in a run-time loop pipelined 3 deep. benchmarks/probe_qgemv.py
    --xp-sweep --fp8-configs timed 13 configs on Llama-8B's four projections on an H200
    (docs/benchmarks/probe_qgemv_fp8_m1_h200.json): this one was best on each, 65.3 µs a layer against 71.1 for the
    unrolled one-column 2048-value tiles before it (which had beaten the tile rule below, 82.1, in
    docs/benchmarks/probe_qgemv_sweep_h200.json, where `ncu` showed that rule at 180 registers a thread and 12.5%
    occupancy on the down projection's K = 14336); pipelined one-column programs were twice as slow.
    Otherwise a tile of TILE_VALUES values (K tiles as `_tile_k`, then as many columns as fit, at most 8), 4 warps:
    the bf16 GEMV's product tile (gemv_triton.default_config), so the registers held are the same while the bytes
    read per tile are a half (FP8) or a quarter (INT4) of its (untuned for two rows and for kernel.py's fp32 INT4
    GEMV, which the half2 one replaces for bf16/fp16 x). fp32 x keeps that rule at one row too: one column a program
    reads all of x per column, four bytes a value against the weight's one (W8A8's Q/DQ'd fp32 x took gate/up from
    50 to 79 µs that way on an H200, docs/benchmarks/qmatmul_nvidia_h200.json's notes)."""
    if rows == 1 and group == 0 and x_bytes <= 2:
        return 4, min(_tile_k(k), FP8_ONE_ROW_TILE_K), 2, 3
    tile_k = max(_tile_k(k), group)
    block_n = max(1, min(8, TILE_VALUES // tile_k))
    return block_n, tile_k, 4


def _chunks(rows: int) -> tuple[int, int]:
    """(programs per column block, rows each) for a step of `rows` rows."""
    chunks = -(-rows // ROWS_PER_PROGRAM)
    return chunks, -(-rows // chunks)


def qgemv(x: torch.Tensor, w: PackedQWeight, config: tuple[int, ...] | None = None, *,
          variant: str | None = None, row_scale: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS, K contiguous, a float dtype) times the packed weight → a new [M, N] in x's
    dtype. config: (BLOCK_N, K values per tile, num_warps[, stages]), the variant's default config by default
    (stages: FP8's and "half2_xp"'s K loop pipelined that deep; FP8 0, the default without it: tiles unrolled).
    variant (INT4/UINT4 only): one of INT4_GEMV_VARIANTS, INT4_GEMV_VARIANT when None; "half2" and "half2_xp" take
    bf16/fp16 x, fp32 x runs "fp32" (half2 would round it to fp16). FP8 weights also take x as an FP8 activation's codes
    (float8_e4m3fn) with row_scale [M] or [M, 1] fp32 and a float out_dtype: one byte of x a value, where the
    Q/DQ'd activation in fp32 is four (the one-row config reads all of x once per output column)."""
    if x.dim() != 2 or x.shape[1] != w.k or not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"qgemv needs x [M <= {MAX_ROWS}, {w.k}]; got {tuple(x.shape)}")
    codes = x.dtype == torch.float8_e4m3fn
    if codes != (row_scale is not None) or (codes and (not w.fp8 or out_dtype not in TL_DTYPES)):
        raise ValueError("qgemv takes FP8 codes only for an FP8 weight, with a row_scale and a float out_dtype")
    if (x.dtype not in TL_DTYPES and not codes) or x.stride(1) != 1 or x.device != w.data.device:
        raise ValueError(f"qgemv needs x of a float dtype with K contiguous on the weight's device; got {x.dtype} "
                         f"{x.stride()} on {x.device}")
    variant = variant or INT4_GEMV_VARIANT
    if variant not in INT4_GEMV_VARIANTS:
        raise ValueError(f"qgemv's variant is one of {INT4_GEMV_VARIANTS}; got {variant!r}")
    half2 = variant in ("half2", "half2_xp") and not w.fp8 and x.dtype in (torch.float16, torch.bfloat16)
    m = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if half2 and variant == "half2_xp":  # x packed once into half2 (and its row scale) by its own launch, then the GEMV
        return qgemv_xp(*pack_x_half2(x, w.group), w, out_dtype, config)
    y = torch.empty(m, w.n, dtype=out_dtype, device=x.device)
    if w.n == 0:
        return y
    if config is None:
        config = (default_config_half2(m, w.n, w.k, w.group) if half2
                  else default_config(m, w.n, w.k, w.group, x.element_size()))
    block_n, tile_k, warps = config[:3]
    chunks, rows = _chunks(m)
    grid = (-(-w.n // block_n) * chunks,)
    common = dict(ROWS=rows, ROWS_PAD=next_pow2(rows), CHUNKS=chunks, BLOCK_N=block_n, OUT_DTYPE=TL_DTYPES[out_dtype],
                  num_warps=warps)
    if w.fp8:
        tiles = -(-w.k // tile_k)
        xs = row_scale.reshape(m) if codes else w.scale  # not read without X_FP8
        assert xs.dtype == torch.float32 and xs.is_contiguous(), (xs.dtype, xs.stride())
        launcher.launch(_qgemv_fp8, grid, x.view(torch.uint8) if codes else x, w.data, w.scale, xs, y, m, w.n, w.k,
                        x.stride(0), w.data.stride(0), y.stride(0), BLOCK_K=tile_k, K_TILES=tiles,
                        EVEN_K=tiles * tile_k == w.k, X_FP8=codes, STAGES=config[3] if len(config) > 3 else 0,
                        **common)
        return y
    if tile_k % w.group or tile_k & (tile_k - 1):
        raise ValueError(f"qgemv's K tile must be a power of two and a multiple of the group {w.group}; got {tile_k}")
    groups = w.k // w.group
    tile_groups = tile_k // w.group
    zero = w.zero if w.zero is not None else w.scale  # not read when ZERO >= 0
    if half2:  # the PTX needs a compiled kernel; the interpreter (CPU tensors) runs the same steps in plain Triton
        common.update(ASM=x.device.type == "cuda", X_CHUNK=x_chunk(w.k))
    launcher.launch(_qgemv_int4_half2 if half2 else _qgemv_int4, grid, x, w.data, w.scale, zero, y, m, w.n,
                    x.stride(0), w.data.stride(0), w.scale.stride(0), y.stride(0), GROUP=w.group, GROUPS=groups,
                    TILE_GROUPS=tile_groups, K_TILES=-(-groups // tile_groups),
                    ZERO=-1 if w.zero is not None else w.zero_const, **common)
    return y


def qgemv_xp(xpack: torch.Tensor, down: torch.Tensor, w: PackedQWeight, out_dtype: torch.dtype,
             config: tuple[int, ...] | None = None) -> torch.Tensor:
    """The "half2_xp" GEMV on x already packed (xpack [M, 4, K/8] int32 and down [M] fp32, as `pack_x_half2` or an
    op's xp form writes them) against an INT4/UINT4 weight → a new [M, N] in out_dtype."""
    m = xpack.shape[0]
    assert not w.fp8 and xpack.shape == (m, 4, w.k // 8) and 0 < m <= MAX_ROWS, (w.fp8, tuple(xpack.shape), w.k)
    y = torch.empty(m, w.n, dtype=out_dtype, device=xpack.device)
    if w.n == 0:
        return y
    block_n, tile_k, warps, *stages = config or default_config_xp(m, w.n, w.k, w.group)
    if tile_k % w.group or tile_k & (tile_k - 1):
        raise ValueError(f"qgemv's K tile must be a power of two and a multiple of the group {w.group}; got {tile_k}")
    chunks, rows = _chunks(m)
    groups, tile_groups = w.k // w.group, tile_k // w.group
    launcher.launch(_qgemv_int4_xp, (-(-w.n // block_n) * chunks,), xpack, down, w.data, w.scale,
                    w.zero if w.zero is not None else w.scale, y, m, w.n, w.data.stride(0), w.scale.stride(0),
                    y.stride(0), ROWS=rows, ROWS_PAD=next_pow2(rows), CHUNKS=chunks, BLOCK_N=block_n,
                    OUT_DTYPE=TL_DTYPES[out_dtype], GROUP=w.group, GROUPS=groups, TILE_GROUPS=tile_groups,
                    K_TILES=-(-groups // tile_groups), ZERO=-1 if w.zero is not None else w.zero_const,
                    STAGES=stages[0] if stages else 1, ASM=xpack.device.type == "cuda", num_warps=warps)
    return y


def packs_x(rows: int, dtype: torch.dtype) -> bool:
    """Whether a weight-only INT4/UINT4 step of `rows` rows of x in `dtype` runs the "half2_xp" GEMV, whose x is
    packed before it (`gemv_max_rows`' rule)."""
    return INT4_GEMV_VARIANT == "half2_xp" and dtype in (torch.float16, torch.bfloat16) and 0 < rows <= XP_GEMV_MAX_ROWS


def x_pack_outputs(rows: int, k: int, group: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """For the xp forms of the ops that produce an INT4 projection's x (kernel_half2.py `pack_x_row`): where a step
    of `rows` rows runs the "half2_xp" GEMV (`packs_x`) on a weight of quantization group `group`, the new xpack
    [rows, 4, k/8] and down [rows] for the GEMV's x and the epilogue's constexprs; else (None, None, {})."""
    if not (packs_x(rows, dtype) and k % group == 0 and group % 8 == 0):
        return None, None, {}
    xpack = torch.empty(rows, 4, k // 8, dtype=torch.int32, device=device)
    down = torch.empty(rows, dtype=torch.float32, device=device)
    chunk = min(XP_CHUNK_WORDS, next_pow2(k // 8))
    return xpack, down, dict(K=k, GROUP=group, X_CHUNK=x_chunk(k), CHUNK_WORDS=chunk, ASM=device.type == "cuda")


def pack_x_half2(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16) → (xpack [M, 4, K/8] int32, down [M] fp32) by `_pack_x_half2` for weights of quantization
    group `group` (qgemv's "half2_xp" variant): XP_CHUNK_WORDS word positions a program, so a long row packs in
    parallel."""
    m, k = x.shape
    xpack = torch.empty(m, 4, k // 8, dtype=torch.int32, device=x.device)
    down = torch.empty(m, dtype=torch.float32, device=x.device)
    chunk = min(XP_CHUNK_WORDS, next_pow2(k // 8))
    launcher.launch(_pack_x_half2, (m, -(-(k // 8) // chunk)), x, xpack, down, x.stride(0), K=k, GROUP=group,
                    X_CHUNK=x_chunk(k), CHUNK_WORDS=chunk, ASM=x.device.type == "cuda", num_warps=4)
    return xpack, down


def gemv_max_rows(w: PackedQWeight, x_dtype: torch.dtype, act_mode: int = ACT_NONE) -> int:
    """Rows of x up to which `qmatmul_packed` runs the GEMV rather than a GEMM: XP_GEMV_MAX_ROWS where the
    "half2_xp" GEMV runs (an INT4/UINT4 weight, weight-only, bf16/fp16 x), else GEMV_MAX_ROWS."""
    if not w.fp8 and act_mode == ACT_NONE and packs_x(1, x_dtype):
        return XP_GEMV_MAX_ROWS
    return GEMV_MAX_ROWS


def qmatmul_packed(x: torch.Tensor, w: PackedQWeight, act_scale: torch.Tensor | None, *, act_mode: int = ACT_NONE,
                   config: tuple[int, int, int] | None = None, dynamic: DynamicScale | None = None) -> torch.Tensor:
    """QMatMul on a packed weight: x [..., K] → [..., N] in x's dtype, dispatched on the step's rows M:

    - weight-only (act_mode none) on CUDA bf16/fp16 x, M >= DEQUANT_MM_MIN_ROWS: the weight dequantized to x's dtype
      in one launch, then cuBLAS (gemm.py `dequant_mm`; each weight value rounded once to x's dtype);
    - FP8 W8A8 (act_mode static or dynamic, an FP8 weight): the activation's FP8 codes and row scale in one launch
      (gemm.py `quantize_fp8_rows`), then `qmatmul_codes` (the GEMV, the Triton GEMM on FP8 tensor cores, or
      torch._scaled_mm from SCALED_MM_MIN_ROWS rows);
    - else M <= `gemv_max_rows` (2, or 4 for INT4 weight-only on bf16/fp16 x): the GEMV on x (an INT4 weight's
      FP8-quantized activation Q/DQ'd to fp32 first; `config` is its config);
    - otherwise the Triton GEMM (gemm.py `qgemm`): on x as is, or on the activation's FP8 codes with its scale as a
      row scale; weights it does not take (INT4 groups below 16) dequantize once and run one fp32 GEMM.

    act_scale None with `dynamic` (act_mode dynamic): the per-token scale is the graph's formula, computed by the
    activation's quantize launch (gemm.py `DynamicScale`), the same values.

    Every path computes the reference's values (qmatmul_ref) up to fp32 summation order (the dequantizing path: and
    the weight's rounding to x's dtype). Callers route CUDA
    tensors here (the CPU runs the reference: trtopt_ops.py); on the CPU the Triton kernels need the interpreter
    (TRITON_INTERPRET=1), which the tests and benchmarks/quant_e2e.py --smoke use. No host sync: the step's CUDA
    graph captures whichever path its M takes."""
    rows = x.numel() // w.k if w.k else 0
    xf = x.reshape(rows, w.k)
    if (act_mode == ACT_NONE and rows >= DEQUANT_MM_MIN_ROWS and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)):
        return dequant_mm(xf, w).reshape(*x.shape[:-1], w.n)
    if act_mode != ACT_NONE and w.fp8 and 0 < rows and (rows <= MAX_ROWS or gemm_supported(w)):
        # W8A8: the activation's codes and row scale in one launch, then the codes' dispatch
        codes, row_scale = quantize_fp8_rows(xf if xf.stride(-1) == 1 else xf.contiguous(), act_scale, dynamic)
        return qmatmul_codes(codes, row_scale, w, out_dtype=x.dtype, config=config).reshape(*x.shape[:-1], w.n)
    if rows > gemv_max_rows(w, x.dtype, act_mode) and gemm_supported(w) and w.k:
        xk = xf if xf.stride(-1) == 1 else xf.contiguous()
        if act_mode == ACT_NONE:
            y = qgemm(xk, w)
        else:  # an FP8-quantized activation before an INT4 weight: the Triton GEMM on its codes
            codes, row_scale = quantize_fp8_rows(xk, act_scale, dynamic)
            y = qgemm(codes, w, row_scale=row_scale.reshape(rows), out_dtype=x.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.n)
    if not 0 < rows <= MAX_ROWS:  # no kernel takes it: the reference's math
        if act_scale is None and act_mode != ACT_NONE:
            act_scale = dynamic.reference(xf)
        if act_mode != ACT_NONE:
            xf = fake_quantize_fp8(xf.float(), act_scale.float().reshape(-1, 1) if act_scale.dim() else
                                   act_scale.float())
        return (xf.float() @ dequantize_packed(w)).to(x.dtype).reshape(*x.shape[:-1], w.n)
    xk = xf if xf.stride(-1) == 1 else xf.contiguous()
    # a Q/DQ'd activation before an INT4 weight stays fp32 in the GEMV (the reference multiplies it in fp32)
    y = qgemv(fake_quantize_fp8_rows(xk, act_scale, dynamic) if act_mode != ACT_NONE else xk, w, config)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.n)


def qmatmul_codes(codes: torch.Tensor, row_scale: torch.Tensor, w: PackedQWeight, *, out_dtype: torch.dtype,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """FP8 W8A8 on an activation already quantized: codes [..., K] float8_e4m3fn (K contiguous) and its row scale
    [M, 1] fp32 (M = the codes' rows) against a packed FP8 weight → [..., N] in out_dtype, dispatched on M: the GEMV
    up to GEMV_MAX_ROWS rows (one byte of x a value, the row scale in the epilogue; `config` is its config), then
    the Triton GEMM on the FP8 tensor cores below SCALED_MM_MIN_ROWS, then torch._scaled_mm where it runs (bf16 out)
    and the Triton GEMM elsewhere. `qmatmul_packed` quantizes and calls this; the torch executor calls it directly
    where the norm before the projection produced the codes (runtime/executors/qmatmul_packing.py)."""
    rows = codes.numel() // w.k if w.k else 0
    assert w.fp8 and codes.dtype == torch.float8_e4m3fn and rows > 0, (w.group, codes.dtype, tuple(codes.shape))
    c = codes.reshape(rows, w.k)
    if rows <= GEMV_MAX_ROWS:
        y = qgemv(c, w, config, row_scale=row_scale, out_dtype=out_dtype)
    elif rows >= SCALED_MM_MIN_ROWS and scaled_mm_supported(c, w, out_dtype):
        y = fp8_scaled_mm(c, w, row_scale)
    else:
        y = qgemm(c, w, row_scale=row_scale.reshape(rows), out_dtype=out_dtype)
    return y.to(out_dtype).reshape(*codes.shape[:-1], w.n)


def qmatmul_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   act_scale: torch.Tensor, act_zero_point: torch.Tensor | None = None,
                   act_quantized: torch.Tensor | None = None, act_static: torch.Tensor | None = None, *,
                   axis: int = 1, block_size: int = 0, act_mode: int = ACT_NONE, act_block_size: int = 0,
                   weight_dtype: int = 0) -> torch.Tensor:
    """QMatMul with the op's arguments (the plan's layout), for callers that did not pack the weight at load (the
    torch.compile custom op, a graph the executor did not rewrite): packs it for this call, then `qmatmul_packed`.
    Packing reads the weight several times, so this is correct but not fast: the torch executor packs once at load
    (runtime/executors/qmatmul_packing.py). Weights `packable` refuses run the reference itself."""
    rows = x.numel() // w_q.shape[0] if w_q.dim() == 2 and w_q.shape[0] else 0
    if not (rows > 0 and packable(w_q, w_scale, block_size=block_size)):
        return qmatmul_ref(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, axis=axis,
                           block_size=block_size, act_mode=act_mode)
    packed = pack_weight(w_q, w_scale, w_zero_point, block_size=block_size)
    return qmatmul_packed(x, packed, act_scale, act_mode=act_mode)
