"""The INT4/UINT4 decode GEMV in packed half2 arithmetic (kernel.py's `qgemv(..., variant="half2")`), for x in
bf16/fp16: the same nibble-plane weights (packing.py, unchanged), 40% of the instructions a value.

Why: kernel.py's fp32 GEMV spends ~7.6 SASS instructions a weight value (sm_90a, 8B shapes: shift, bitfield
extract, or-magic, fp32 sub, fp32 FMA, and a bf16 load and widening of x every two values), so it issues far below
HBM's rate (0.75-1.0 TB/s of 4.8 on an H200, docs/benchmarks/qmatmul_nvidia_h200.json). This one measures ~3.0
(one row; 4.8 at two, which share the dequantization) in the same build. Per int32 word (eight values; nibble p at
bits 4p.., planes p and p + 4 pair up as the low and high half of a half2):

- dequantize (`_dequant`, Marlin's magic numbers): (w & 0x000F000F) | 0x64006400 is the half2 (1024 + u_p,
  1024 + u_p+4); the mask 0x00F000F0 gives 1024 + 16u; one shift by 8 reaches planes 2, 3, 6, 7. Then sub.f16x2 of
  1024 + z' (or fma.rn.f16x2 by 1/16 minus 64 + z') leaves u − z' = q − z exactly: 1 shift + 4 lop3 + 4 half2 ops.
- multiply (`_dot8`): the four weight half2 against four half2 of x (one mul + three fma.rn.f16x2: each lane sums
  four products in fp16), then both lanes widened and added in fp32: 7 ops for eight products. Across words and
  groups the sums are fp32 (an FMA by the group's scale into a tile-shaped accumulator, reduced once at the end).
- x is read once a tile for all BLOCK_N columns a program owns (each thread holds all of them), packed into those
  half2 pairs (`_pack`: one cvt.rn.f16x2.f32) after multiplying by a power of two 2^e per row (`_row_scale`, once
  a program, from the row's largest |x|, which lands in [128, 256)): a product is at most 256 · 15, a lane's four at
  most 15360 < 65504 (fp16's largest), whatever the activations' range; the 2^-e multiplies the row's sum. Exact:
  bf16 and fp16 values keep all their bits in fp16 at that range (only values 2^22 below the row's largest go
  subnormal). fp32 x would round to fp16, so kernel.py runs fp32 x on its fp32 GEMV.

Rounding: products of x (8 significant bits from bf16) and q − z (4) have up to 12 bits, fp16 keeps 11, and each
lane's four-term sum rounds in fp16; about 2^-12 relative a word, far below the bf16 output's 2^-9 (the result
equals `qmatmul_ref` within the bf16 tolerances of tests/plugins/test_qmatmul_kernel.py).

Two kernels share that math. `_qgemv_int4_half2` (variant "half2") converts x in the GEMV: each program reads the
row's largest |x| first, then packs x per unrolled K tile for its 8 columns; `ncu` on an H200 read 153-255
registers a thread, 12.5-18.75% occupancy and DRAM 19-35% busy. `_qgemv_int4_xp` (variant "half2_xp", the
default) takes x from `_pack_x_half2`, one small launch before it that writes x · 2^e as the half2 words in
nibble-plane order (and 2^-e), so the GEMV only loads them, and its K loop runs at run time, software-pipelined
(`tl.range(num_stages=...)`) with a few weight words a thread: Llama-8B's four projections 74.0 -> 54.2 µs a layer
at one row, the x launch's 7.5 included (docs/benchmarks/probe_qgemv_xp2_m1_h200.json).

The half2 instructions are PTX (`tl.inline_asm_elementwise`), which the Triton interpreter cannot run: with
ASM=False the same kernel computes each step with plain Triton ops on the same packed half2 words (dequantized
weights, packed x) and multiplies in fp32, so the CPU tests cover every index, the packing and the scaling; the
PTX bodies are covered by the `gpu` tests, and tests/runtime/test_kernels_compile.py-style compilation for sm_90
(tests/plugins/test_qmatmul_kernel.py `test_half2_gemv_compiles_for_sm90`).
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp16 bit patterns: 1024.0 (the magic exponent: mantissa bit 0 is worth 1), 1/16, and the per-zero-point offsets.
F16_1024 = tl.constexpr(0x6400)
# `_row_scale`'s target here: a row's largest |x| · 2^e in [2^7, 2^8), so a lane's four products stay below 65504
ROW_SCALE_TOP = tl.constexpr(7)
F16_MINUS_64 = tl.constexpr(0xD400)  # -64.0; -(64 + z') = F16_MINUS_64 + 16·z' (mantissa bit 0 is worth 1/16 at 64)


@triton.jit
def program_columns(N, CHUNKS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The decode GEMVs' program p (kernel.py and this module): its first row of x, (p % CHUNKS)·ROWS, and its
    columns (p // CHUNKS)·BLOCK_N.. with their mask and their indices clamped to N − 1 (read, never stored)."""
    pid = tl.program_id(0)
    offs_n = (pid // CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (pid % CHUNKS) * ROWS, offs_n, offs_n < N, tl.minimum(offs_n, N - 1).to(tl.int64)


@triton.jit
def zero_half2(Z, s_off, g_ok, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, ZERO: tl.constexpr):
    """`_dequant`'s zlo, zhi for a tile: the half2 (1024 + z', 1024 + z') and (−(64 + z'), −(64 + z')) as int32 bits,
    from the constant z' ZERO >= 0, or loaded from Z [N, GROUPS] at the scales' offsets."""
    if ZERO >= 0:
        zlo = tl.full((BLOCK_N, TILE_GROUPS, 1), (F16_1024 + ZERO) * 65537, tl.int32)
        # the half2 −(64 + z') twice is above 2³¹: its int32 bits are the value − 2³²
        zhi = tl.full((BLOCK_N, TILE_GROUPS, 1), (F16_MINUS_64 + 16 * ZERO) * 65537 - 2**32, tl.int32)
    else:
        z = tl.load(Z + s_off, mask=g_ok[None, :], other=0).to(tl.int32)
        zlo = ((z + F16_1024) * 65537)[:, :, None]
        zhi = ((z * 16 + F16_MINUS_64) * 65537)[:, :, None]  # wraps to the same int32 bits
    return zlo, zhi


@triton.jit
def load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t, TILE_GROUPS: tl.constexpr, GROUPS: tl.constexpr,
                   WORDS: tl.constexpr):
    """K tile t of an INT4 GEMV (this module's and kernel.py's `_qgemv_int4`): the words [BLOCK_N, TILE_GROUPS,
    WORDS] int32 of columns safe_n, their group scales [BLOCK_N, TILE_GROUPS] in fp32, the tile's group indices and
    mask, and the scales' offsets (the zero points share them). Groups past GROUPS read as zeros."""
    offs_g = t * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
    g_ok = offs_g < GROUPS
    w_ptr = W + safe_n[:, None, None] * stride_wn + offs_g[None, :, None] * WORDS + offs_j[None, None, :]
    s_off = safe_n[:, None] * stride_sn + offs_g[None, :]
    if GROUPS % TILE_GROUPS == 0:
        b = tl.load(w_ptr)
        s = tl.load(S + s_off).to(tl.float32)
    else:
        b = tl.load(w_ptr, mask=g_ok[None, :, None], other=0)
        s = tl.load(S + s_off, mask=g_ok[None, :], other=0.0).to(tl.float32)
    return b, s, offs_g, g_ok, s_off


@triton.jit
def _dequant(b, zlo, zhi, ASM: tl.constexpr):
    """b: int32 words (nibble planes) → four int32 holding half2 (q − z of plane p, of plane p + 4), p = 0..3.
    zlo: half2 (1024 + z', 1024 + z'); zhi: half2 (−(64 + z'), −(64 + z')), as int32 bits."""
    if ASM:
        return tl.inline_asm_elementwise(
            # Temporaries until the end: an output register may be an input's (no early clobber).
            asm="""
            {
            .reg .b32 t, m, h0, h1, h2, h3;
            lop3.b32 h0, $4, 0x000f000f, 0x64006400, 0xea;
            lop3.b32 h1, $4, 0x00f000f0, 0x64006400, 0xea;
            shr.u32 t, $4, 8;
            lop3.b32 h2, t, 0x000f000f, 0x64006400, 0xea;
            lop3.b32 h3, t, 0x00f000f0, 0x64006400, 0xea;
            mov.b32 m, 0x2c002c00;
            sub.f16x2 h0, h0, $5;
            fma.rn.f16x2 h1, h1, m, $6;
            sub.f16x2 h2, h2, $5;
            fma.rn.f16x2 h3, h3, m, $6;
            mov.b32 $0, h0;
            mov.b32 $1, h1;
            mov.b32 $2, h2;
            mov.b32 $3, h3;
            }
            """,
            constraints="=r,=r,=r,=r,r,r,r",
            args=[b, zlo, zhi],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        # The same half2 bits from integer math: q − z as an exact fp16 per nibble, low half plane p, high p + 4.
        bu = b.to(tl.uint32, bitcast=True)
        z = (zlo & 0xFFFF) - F16_1024  # z' back from its fp16 1024 + z'
        w0 = _pair(((bu >> 0) & 15).to(tl.int32) - z, ((bu >> 16) & 15).to(tl.int32) - z)
        w1 = _pair(((bu >> 4) & 15).to(tl.int32) - z, ((bu >> 20) & 15).to(tl.int32) - z)
        w2 = _pair(((bu >> 8) & 15).to(tl.int32) - z, ((bu >> 24) & 15).to(tl.int32) - z)
        w3 = _pair(((bu >> 12) & 15).to(tl.int32) - z, ((bu >> 28) & 15).to(tl.int32) - z)
        return w0, w1, w2, w3


@triton.jit
def _pair(lo, hi):
    """Two float/int tensors → int32 bits of the half2 (lo, hi) (the pure-Triton path)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


@triton.jit
def _half(h, HIGH: tl.constexpr):
    """The low (HIGH=False) or high half of int32 half2 bits, as fp32 (the pure-Triton path)."""
    if HIGH:
        h = h >> 16
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pack(lo, hi, ASM: tl.constexpr):
    """fp32 lo, hi (exactly representable in fp16 here) → int32 bits of the half2 (lo, hi)."""
    if ASM:
        return tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,f,f", args=[lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _pair(lo, hi)


@triton.jit
def _dot8(w0, w1, w2, w3, x0, x1, x2, x3, ASM: tl.constexpr):
    """Σ of the eight products of four weight half2 and four x half2 (int32 bits) → fp32."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 h;
            .reg .f16 lo, hi;
            .reg .f32 flo, fhi;
            mul.rn.f16x2 h, $1, $5;
            fma.rn.f16x2 h, $2, $6, h;
            fma.rn.f16x2 h, $3, $7, h;
            fma.rn.f16x2 h, $4, $8, h;
            mov.b32 {lo, hi}, h;
            cvt.f32.f16 flo, lo;
            cvt.f32.f16 fhi, hi;
            add.f32 $0, flo, fhi;
            }
            """,
            constraints="=f,r,r,r,r,r,r,r,r",
            args=[w0, w1, w2, w3, x0, x1, x2, x3],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        s = _half(w0, False) * _half(x0, False) + _half(w0, True) * _half(x0, True)
        s += _half(w1, False) * _half(x1, False) + _half(w1, True) * _half(x1, True)
        s += _half(w2, False) * _half(x2, False) + _half(w2, True) * _half(x2, True)
        s += _half(w3, False) * _half(x3, False) + _half(w3, True) * _half(x3, True)
        return s


@triton.jit
def _row_scale(x_row, k_end, K: tl.constexpr, CHUNK: tl.constexpr, TOP: tl.constexpr):
    """(2^e, 2^-e) for one row of x (k_end: K, or 0 for a row past M): e puts the row's largest |x| · 2^e in
    [2^TOP, 2^(TOP+1)) (this module's GEMV: TOP = ROW_SCALE_TOP, [128, 256)). Read in CHUNK-value slices, once per
    program (x is small and stays in L1/L2)."""
    big = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in tl.static_range(0, K, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        big = tl.maximum(big, tl.abs(tl.load(x_row + offs, mask=offs < k_end, other=0.0).to(tl.float32)))
    amax = tl.max(big, axis=0)
    # Biased exponent E of amax, clamped so both powers of two are normal: 2^e = 2^(127 + TOP − E), 2^-e = 2^(E −
    # 127 − TOP), as fp32 bits (254 + TOP − E) << 23 and (E − TOP) << 23.
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 255, TOP + 1), 254)
    return ((254 - e + TOP) << 23).to(tl.float32, bitcast=True), ((e - TOP) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_half2(x_row, x_off, x_ok, up, WORDS: tl.constexpr, ASM: tl.constexpr):
    """One row's x over a tile ([1, TILE_GROUPS, WORDS] positions, plane 0's K at x_off), times up = 2^e → four int32
    of half2 (plane p, plane p + 4), p = 0..3."""
    x0 = tl.load(x_row + x_off, mask=x_ok, other=0.0).to(tl.float32) * up
    x1 = tl.load(x_row + x_off + WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x2 = tl.load(x_row + x_off + 2 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x3 = tl.load(x_row + x_off + 3 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x4 = tl.load(x_row + x_off + 4 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x5 = tl.load(x_row + x_off + 5 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x6 = tl.load(x_row + x_off + 6 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    x7 = tl.load(x_row + x_off + 7 * WORDS, mask=x_ok, other=0.0).to(tl.float32) * up
    return _pack(x0, x4, ASM), _pack(x1, x5, ASM), _pack(x2, x6, ASM), _pack(x3, x7, ASM)


@triton.jit
def _fold_row(part, s, down, acc, acc0, acc1, offs_r, r: tl.constexpr, ROWS: tl.constexpr):
    """Row r's products of one K tile (part [BLOCK_N, TILE_GROUPS, WORDS]) × their group scales s, into the
    accumulators: one or two rows keep a tile-shaped partial each (acc0, acc1), reduced once by `_row_sums`; more
    rows reduce each tile into acc's row r, × down (2^-e of that row). Returns (acc, acc0, acc1)."""
    if ROWS <= 2:
        if r == 0:
            acc0 += part * s
        else:
            acc1 += part * s
    else:
        part = tl.sum(tl.sum(part * s, axis=2), axis=1) * down
        acc += tl.where(offs_r[:, None] == r, part[None, :], 0.0)
    return acc, acc0, acc1


@triton.jit
def _row_sums(acc, acc0, acc1, down0, down1, offs_r, ROWS: tl.constexpr):
    """acc with rows 0 and 1 set to their partials' sums × down0, down1, where `_fold_row` kept partials (ROWS
    <= 2); as it is for more rows."""
    if ROWS <= 2:
        acc = tl.where(offs_r[:, None] == 0, (tl.sum(tl.sum(acc0, axis=2), axis=1) * down0)[None, :], acc)
        if ROWS == 2:
            acc = tl.where(offs_r[:, None] == 1, (tl.sum(tl.sum(acc1, axis=2), axis=1) * down1)[None, :], acc)
    return acc


@triton.jit
def _qgemv_int4_half2(X, W, S, Z, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym,
                      ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUP: tl.constexpr, GROUPS: tl.constexpr, TILE_GROUPS: tl.constexpr, K_TILES: tl.constexpr,
                      ZERO: tl.constexpr, OUT_DTYPE: tl.constexpr, X_CHUNK: tl.constexpr, ASM: tl.constexpr):
    """kernel.py `_qgemv_int4`'s grid and arguments (program p: columns (p // CHUNKS)·BLOCK_N.., rows
    (p % CHUNKS)·ROWS..; columns past N clamped, never stored), in half2 arithmetic (module docstring). One or two
    rows: a tile-shaped fp32 accumulator a row, reduced once at the end; more: each row's tile reduced per tile.
    X_CHUNK: x values a slice when finding a row's largest |x| (a power of two; `X_CHUNK_VALUES`)."""
    WORDS: tl.constexpr = GROUP // 8
    row0, offs_n, n_ok, safe_n = program_columns(N, CHUNKS, ROWS, BLOCK_N)
    offs_j = tl.arange(0, WORDS)
    offs_r = tl.arange(0, ROWS_PAD)
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    K: tl.constexpr = GROUPS * GROUP
    up0, down0 = _row_scale(X + row0 * stride_xm, tl.where(row0 < M, K, 0), K, X_CHUNK, ROW_SCALE_TOP)
    up1, down1 = up0, down0
    if ROWS == 2:
        up1, down1 = _row_scale(X + (row0 + 1) * stride_xm, tl.where(row0 + 1 < M, K, 0), K, X_CHUNK,
                                ROW_SCALE_TOP)
    for t in tl.static_range(K_TILES):
        b, s, offs_g, g_ok, s_off = load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t, TILE_GROUPS, GROUPS,
                                                   WORDS)
        zlo, zhi = zero_half2(Z, s_off, g_ok, BLOCK_N, TILE_GROUPS, ZERO)
        w0, w1, w2, w3 = _dequant(b, zlo, zhi, ASM)
        s = s[:, :, None]
        x_off = (offs_g[:, None] * GROUP + offs_j[None, :])[None, :, :]  # [1, TILE_GROUPS, WORDS]: plane 0's K
        for r in tl.static_range(ROWS):
            x_ok = offs_g[None, :, None] < tl.where(row0 + r < M, GROUPS, 0)  # a row past M reads nothing
            if ROWS <= 2:
                up = up0 if r == 0 else up1
                down = down0 if r == 0 else down1
            else:
                up, down = _row_scale(X + (row0 + r) * stride_xm, tl.where(row0 + r < M, K, 0), K, X_CHUNK,
                                      ROW_SCALE_TOP)
            x0, x1, x2, x3 = _x_half2(X + (row0 + r) * stride_xm, x_off, x_ok, up, WORDS, ASM)
            part = _dot8(w0, w1, w2, w3, x0, x1, x2, x3, ASM)  # [BLOCK_N, TILE_GROUPS, WORDS]
            acc, acc0, acc1 = _fold_row(part, s, down, acc, acc0, acc1, offs_r, r, ROWS)
    acc = _row_sums(acc, acc0, acc1, down0, down1, offs_r, ROWS)  # 2^-e once, on the row's sum
    rows = row0 + offs_r
    row_ok = (offs_r < ROWS) & (rows < M)  # this program's rows only, as in kernel.py
    out = Y + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _pack_x_half2(X, XP, DOWN, stride_xm, K: tl.constexpr, GROUP: tl.constexpr, X_CHUNK: tl.constexpr,
                  CHUNK_WORDS: tl.constexpr, ASM: tl.constexpr):
    """`qgemv(..., variant="half2_xp")`'s first launch, program (m, c) for row m of x and word positions
    c·CHUNK_WORDS..: the row's (2^e, 2^-e) (`_row_scale`, each program from the whole row: it is small and in L2),
    then x · 2^e as the half2 the GEMV multiplies, XP [M, 4, K/8] int32: XP[m, p, w] holds (plane p, plane p + 4)
    of word position w = g·W + j (group g, word j: K positions g·GROUP + p·W + j), so the GEMV loads each plane
    pair contiguously; DOWN[m] = 2^-e (stored by program c = 0)."""
    m = tl.program_id(0)
    c = tl.program_id(1)
    x_row = X + m * stride_xm
    up, down = _row_scale(x_row, K, K, X_CHUNK, ROW_SCALE_TOP)
    _store_x_words(x_row, XP + m * 4 * (K // 8), c * CHUNK_WORDS, up, K, GROUP, CHUNK_WORDS, ASM)
    if c == 0:
        tl.store(DOWN + m, down)


@triton.jit
def _store_x_words(x_row, xp_row, w0, up, K: tl.constexpr, GROUP: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                   ASM: tl.constexpr):
    """Word positions w0.. w0 + CHUNK_WORDS of one row of x · up, laid out in xp_row [4, K/8] as `_pack_x_half2`
    says."""
    WORDS: tl.constexpr = GROUP // 8
    KW: tl.constexpr = K // 8
    w = w0 + tl.arange(0, CHUNK_WORDS)
    ok = w < KW
    x0, x1, x2, x3 = _x_half2(x_row, (w // WORDS) * GROUP + w % WORDS, ok, up, WORDS, ASM)  # plane 0's K
    out = xp_row + w
    tl.store(out, x0, mask=ok)
    tl.store(out + KW, x1, mask=ok)
    tl.store(out + 2 * KW, x2, mask=ok)
    tl.store(out + 3 * KW, x3, mask=ok)


@triton.jit
def pack_x_row(x_row, xp_row, down_ptr, K: tl.constexpr, GROUP: tl.constexpr, X_CHUNK: tl.constexpr,
               CHUNK_WORDS: tl.constexpr, ASM: tl.constexpr):
    """The epilogue of the ops' "xp" forms that produce an INT4 projection's x (RMSNorm, AddRMSNorm, SiluMul,
    GeluMul: runtime/executors/qmatmul_packing.py `fuse_norm_pack_x`): the row of x this program has just stored at
    x_row, packed by the same steps as `_pack_x_half2` (the same words, bit for bit) into xp_row [4, K/8], and its
    2^-e to down_ptr. One program does the whole row, where the separate launch spreads it over up to 7."""
    tl.debug_barrier()  # every thread's stores of the row are visible to every thread's loads below
    up, down = _row_scale(x_row, K, K, X_CHUNK, ROW_SCALE_TOP)
    for c in tl.range(0, K // 8, CHUNK_WORDS):
        _store_x_words(x_row, xp_row, c, up, K, GROUP, CHUNK_WORDS, ASM)
    tl.store(down_ptr, down)


@triton.jit
def _qgemv_int4_xp(XP, DOWN, W, S, Z, Y, M, N, stride_wn, stride_sn, stride_ym,
                   ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP: tl.constexpr, GROUPS: tl.constexpr, TILE_GROUPS: tl.constexpr, K_TILES: tl.constexpr,
                   ZERO: tl.constexpr, OUT_DTYPE: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr):
    """`_qgemv_int4_half2`'s grid, weights and math, with x already packed by `_pack_x_half2` (XP, DOWN): no
    row-scale prologue and no x conversion in the loop, which walks K at run time (tl.range, STAGES deep) instead of
    unrolling every tile, so a thread holds one tile's registers and more warps fit a multiprocessor."""
    WORDS: tl.constexpr = GROUP // 8
    KW: tl.constexpr = GROUPS * WORDS
    row0, offs_n, n_ok, safe_n = program_columns(N, CHUNKS, ROWS, BLOCK_N)
    offs_j = tl.arange(0, WORDS)
    offs_r = tl.arange(0, ROWS_PAD)
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    for t in tl.range(K_TILES, num_stages=STAGES):
        b, s, offs_g, g_ok, s_off = load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t, TILE_GROUPS, GROUPS,
                                                   WORDS)
        zlo, zhi = zero_half2(Z, s_off, g_ok, BLOCK_N, TILE_GROUPS, ZERO)
        w0, w1, w2, w3 = _dequant(b, zlo, zhi, ASM)
        s = s[:, :, None]
        x_off = (offs_g[:, None] * WORDS + offs_j[None, :])[None, :, :]  # [1, TILE_GROUPS, WORDS]: word positions
        for r in tl.static_range(ROWS):
            x_ok = offs_g[None, :, None] < tl.where(row0 + r < M, GROUPS, 0)  # a row past M reads nothing
            xp = XP + (row0 + r) * 4 * KW + x_off
            x0 = tl.load(xp, mask=x_ok, other=0)
            x1 = tl.load(xp + KW, mask=x_ok, other=0)
            x2 = tl.load(xp + 2 * KW, mask=x_ok, other=0)
            x3 = tl.load(xp + 3 * KW, mask=x_ok, other=0)
            part = _dot8(w0, w1, w2, w3, x0, x1, x2, x3, ASM)  # [BLOCK_N, TILE_GROUPS, WORDS]
            acc, acc0, acc1 = _fold_row(part, s, 1.0, acc, acc0, acc1, offs_r, r, ROWS)  # 2^-e after the loop
    acc = _row_sums(acc, acc0, acc1, 1.0, 1.0, offs_r, ROWS)
    rows = row0 + offs_r
    row_ok = (offs_r < ROWS) & (rows < M)
    acc *= tl.load(DOWN + rows, mask=row_ok, other=0.0)[:, None]  # 2^-e once, on the row's sum
    out = Y + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


X_CHUNK_VALUES = 1024  # x values one slice of `_row_scale` reads (at most; a power of two)


def x_chunk(k: int) -> int:
    """_qgemv_int4_half2's X_CHUNK for K values of x."""
    return min(X_CHUNK_VALUES, triton.next_power_of_2(k))


ONE_ROW_TILE_K = 1024  # K values a tile of the one-row half2 GEMV (whole groups: at least one group)


def default_config_half2(rows: int, n: int, k: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_N, K values per tile, num_warps) for the half2 GEMV: 8 columns a program, held by each thread (x is
    read and packed once for all eight); the last K tile is masked when it does not divide K.

    One row: 2 warps, tiles of ONE_ROW_TILE_K values. The first default (tiles of 2048) held 255 registers a thread
    (`ncu` on an H200: 12.5% theoretical occupancy, DRAM 21-31% busy on Llama-8B's gate/up and down projections);
    benchmarks/probe_qgemv.py --sweep timed 37 configs on the four projections (docs/benchmarks/
    probe_qgemv_sweep_h200.json) and this one took them from 86.4 µs a layer to 74.0 (within 5% of the best sum,
    73.2, at 8 warps, which was 10% slower on Q/K/V). Two rows take 4 warps and tiles of
    4096: on an H200 (docs/benchmarks/qmatmul_int4_gemv_h200.json, Llama-8B's projections) that config beat the
    2-warp one at M = 2 on every projection but O (1.04-1.18x of bf16 against 0.64-1.03x). benchmarks/
    bench_qmatmul.py --int4-configs times alternatives."""
    if rows == 1:
        return 8, max(group, min(ONE_ROW_TILE_K, triton.next_power_of_2(k))), 2
    return 8, max(group, min(4096, triton.next_power_of_2(k))), 4


XP_MANY_COLUMNS = 16384  # N from which `default_config_xp` gives a program fewer warps (one row) or more columns


def default_config_xp(rows: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, K values per tile, num_warps, pipeline stages) for `_qgemv_int4_xp`, from benchmarks/probe_qgemv.py
    --xp-sweep on an H200 (docs/benchmarks/probe_qgemv_xp_m{1,2}_h200.json: 26 configs on Llama-8B's four
    projections, the x launch included). One row: 4 columns, three stages, 8 words a thread; 1 warp and tiles of 512
    values where N is large (gate/up's 28672: 23.0 µs against 25.6), else 2 warps and tiles of 1024 (Q/K/V, O,
    down: 8.7, 7.3, 16.5 µs against bf16's 15.5, 11.5, 31.2). Two rows: 8 columns, 4 warps, tiles of 512 unpipelined
    where N is large (34.9 µs against 42.3), else 4 columns, 2 warps, three stages. Three and four rows (the GEMV
    runs them for INT4: kernel.py XP_GEMV_MAX_ROWS): 4 columns, 1 warp, tiles of 512, three stages, best on all four
    projections at 4 rows (probe_qgemv_xp_m4_h200.json: 18.0, 14.3, 65.9, 40.5 µs; 3 rows not timed). The tile is
    whole groups."""
    many = n >= XP_MANY_COLUMNS
    if rows == 1:
        block_n, tile, warps, stages = (4, 512, 1, 3) if many else (4, 1024, 2, 3)
    elif rows == 2:
        block_n, tile, warps, stages = (8, 512, 4, 1) if many else (4, 512, 2, 3)
    else:
        block_n, tile, warps, stages = 4, 512, 1, 3
    return block_n, max(group, min(tile, triton.next_power_of_2(k))), warps, stages
