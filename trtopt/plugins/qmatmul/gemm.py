"""QMatMul's tensor-core path (face 4 of docs/architecture.md §4): the GEMMs kernel.py `qmatmul_packed` dispatches
steps of more than GEMV_MAX_ROWS rows to (prefill, large decode batches), over the same packed weights as the GEMV
(packing.py: one layout, no second copy).

- `qgemm`: a Triton GEMM, tl.dot on x's dtype (bf16/fp16 tensor cores; fp32 "ieee" for fp32 plans), the weight
  dequantized in registers per K block:
  - FP8: the [N, K] float8e4nv bytes widened to x's dtype (exact: every E4M3 value is a bf16/fp16 value), one
    tl.dot accumulating over K, the per-column scale applied once in the epilogue;
  - INT4/UINT4: a K block lies inside one quantization group (BLOCK_K <= G, or a whole group): its nibble planes
    are unpacked to q − z (exact, |q − z| <= 15), one tl.dot per block, and the group's scale multiplies that
    block's fp32 partial sum: s[g, n] · Σ_{k∈g} x[k] (q − z), the GEMV's order (kernel.py), not (q − z) · s rounded
    to bf16 as Marlin-style kernels do. That order (GemmConfig.fold_scale, the dots chained on one accumulator) was
    timed too and was not faster: Llama-8B's projections at 16 rows on an H200, 219 µs a layer folded against 206
    (docs/benchmarks/probe_gemm_sweep_m16_int4_h200.json), so the exact order stays.
  - An optional per-row scale in the epilogue (ROW_SCALE): x holds FP8 codes of an FP8-quantized activation
    (exact in any float dtype) and the row scale is the activation's scale.
  So the result is the reference's ((Q/DQ(x)) @ DQ(w) in fp32, reference.py) up to fp32 summation order, rounded
  once to x's dtype. Configs come from a small table by M (`gemm_config`), no autotuning: the step CUDA graphs
  capture whatever launches, and an autotuner would time kernels on the first capture.
- `fp8_scaled_mm`: FP8 W8A8 (static per-tensor or dynamic per-token activation scale) on Hopper's FP8 tensor cores
  through torch._scaled_mm (cuBLASLt): x's FP8 codes [M, K] row-major, the packed weight's [N, K] bytes viewed as
  the column-major [K, N] it wants, rowwise scales (scale_a [M, 1] fp32: the activation's scale per row;
  scale_b [1, N] fp32: the packed FP8 scale, stored fp32 for this), bf16 out, fp32 accumulation (use_fast_accum off:
  the FP8 fast-accumulation mode is the one that loses precision). Taken for bf16 x with K and N multiples of 16 on
  compute capability >= 9.0 (rowwise scaling's requirements: torch's `_check_scaled_mm_sizes`, Blas.cpp); else
  the Triton GEMM with ROW_SCALE, which computes the same product.

FP8 weight-only steps stay weight-only (the Triton GEMM on x as is): quantizing their activations per token to reach
_scaled_mm would change the plan's numerics (W8A16 → W8A8). Nothing here syncs the host or allocates outside
torch's allocator (the CUDA graph pool during capture): the outputs and the activation codes are torch tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES
from trtopt.plugins.qmatmul.packing import PackedQWeight
from trtopt.plugins.qmatmul.reference import FP8_MAX

MAX_INT4_BLOCK_K = 256  # an INT4 K block is min(G, 128) values, at least one word per plane (G/8); above: no GEMM
# W8A8 steps of at least this many rows take torch._scaled_mm; fewer take the GEMV (up to kernel.py's GEMV_MAX_ROWS)
# or the Triton GEMM on the FP8 tensor cores (`fp8_dot_config`'s 16-row tile). On an H200 at 16 rows that GEMM beat
# _scaled_mm on all eight Llama projections of the 1.24B and 8B shapes (8B gate/up 32.7 us against 45.3, Q/K/V 13.4
# against 16.1; 1.24B Q/K/V 7.2 against 8.7). _scaled_mm's cuBLASLt kernel with rowwise scales was one 128 x 128 tile
# for every shape (nvjet_sm90_qqtst_128x128_128x6 in torch.profiler). From 64 rows on the Triton GEMM's 64- and
# 128-row tiles won on three of eight projections and lost by up to 2.6x at 256-512 rows
# (docs/benchmarks/qmatmul_w8a8_{1b,8b}_nvidia_h200.json). Before the FP8 dot (the codes widened to bf16) the Triton
# GEMM lost from 2 rows (docs/benchmarks/qmatmul_nvidia_h200.json).
SCALED_MM_MIN_ROWS = 17


@triton.jit
def _qgemm(X, W, S, Z, XS, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
           INT4: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, X_FP8: tl.constexpr, ROW_SCALE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
           FOLD_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
           OUT_DTYPE: tl.constexpr, FP8_DOT: tl.constexpr = False):
    """Program p: a BLOCK_M × BLOCK_N tile of y, GROUP_M row tiles per column band (the Triton tutorial's L2
    ordering). Rows past M and columns past N are clamped to M − 1 / N − 1 (read, never stored), so only K needs a
    mask, and only for FP8 (INT4's K is whole groups, a multiple of BLOCK_K). X_FP8: x is FP8 codes as uint8.
    INT4: W [N, K/8] int32 nibble planes (packing.py), S and Z [N, K/G] (stride_sn), ZERO >= 0 a constant z';
    FOLD_SCALE: each dequantized value (q − z) · s is rounded to DOT_DTYPE before the dot (module docstring).
    FP8_DOT (X_FP8 with an FP8 weight, DOT_DTYPE float8e4nv): both operands stay FP8 codes on the FP8 tensor cores;
    each K block's dot starts from zero and is added to the fp32 accumulator (the tensor cores' FP8 accumulation
    keeps fewer bits than fp32, so it never runs longer than one block, as cuBLAS's use_fast_accum=False)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_band = GROUP_M * tiles_n
    first_m = (pid // per_band) * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_band) % band_m
    pid_n = (pid % per_band) // band_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = X + safe_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT4:
        WORDS: tl.constexpr = GROUP // 8  # words of one column's group, one per value of each plane
        PLANES: tl.constexpr = BLOCK_K // WORDS  # planes of the group one K block covers
        SUB: tl.constexpr = GROUP // BLOCK_K  # K blocks per group
        offs_j = tl.arange(0, WORDS)
        offs_p = tl.arange(0, PLANES)
        for kb in range(0, K // BLOCK_K):
            g = kb // SUB
            x = tl.load(x_rows + (kb * BLOCK_K + offs_k)[None, :])  # [BLOCK_M, BLOCK_K]
            if X_FP8:
                x = x.to(tl.float8e4nv, bitcast=True)
            x = x.to(DOT_DTYPE)
            words = tl.load(W + safe_n[None, :] * stride_wn + g * WORDS + offs_j[:, None])  # [WORDS, BLOCK_N]
            words = words.to(tl.uint32, bitcast=True)  # logical shifts
            shifts = (4 * ((kb % SUB) * PLANES + offs_p)).to(tl.uint32)
            u = (words[None, :, :] >> shifts[:, None, None]) & 15  # [PLANES, WORDS, BLOCK_N]: value p·W + j
            v = (u | 0x4B000000).to(tl.float32, bitcast=True)  # 2²³ + u, exact (kernel.py)
            if ZERO >= 0:
                v = v - (8388608.0 + ZERO)
            else:
                z = tl.load(Z + safe_n * stride_sn + g).to(tl.float32)
                v = v - (z + 8388608.0)[None, None, :]
            s = tl.load(S + safe_n * stride_sn + g).to(tl.float32)
            if FOLD_SCALE:  # (q − z) · s rounded to the dot's dtype; the dots chain on one accumulator
                w = tl.reshape(v * s[None, None, :], (BLOCK_K, BLOCK_N)).to(DOT_DTYPE)
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            else:
                w = tl.reshape(v, (BLOCK_K, BLOCK_N)).to(DOT_DTYPE)  # q − z, K in the block's order
                acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
    else:
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + offs_k
            x = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0)
            if X_FP8:
                x = x.to(tl.float8e4nv, bitcast=True)
            x = x.to(DOT_DTYPE)
            w = tl.load(W + safe_n[None, :] * stride_wn + k[:, None], mask=k[:, None] < K, other=0)  # [BK, BN]
            w = w.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
            if FP8_DOT:
                acc += tl.dot(x, w)
            else:
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        acc = acc * tl.load(S + safe_n).to(tl.float32)[None, :]
    if ROW_SCALE:
        acc = acc * tl.load(XS + safe_m).to(tl.float32)[:, None]
    out = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(OUT_DTYPE), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """One launch of `_qgemm`: its tile and pipeline."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # INT4: multiply each dequantized value by its group's scale before the dot, rounded to the dot's dtype (a
    # probe: not faster, module docstring)
    fold_scale: bool = False


def int4_block_k(group: int) -> int | None:
    """K values of one INT4 K block for quantization group G: min(G, 128), and at least G/8 (one word of each
    plane); None when tl.dot cannot take it (G < 16) or it exceeds MAX_INT4_BLOCK_K."""
    block_k = max(min(group, 128), group // 8)
    return block_k if 16 <= block_k <= MAX_INT4_BLOCK_K else None


def gemm_config(rows: int, group: int, dtype: torch.dtype) -> GemmConfig:
    """The tile for `rows` rows against a packed weight (group 0: FP8) with x of `dtype`. Small steps: short row
    tiles and narrow column tiles, so that the grid still covers the SMs while the weight is streamed about once;
    prefill: the Triton tutorial's 128 × 128 Hopper tile for FP8. INT4 tiles are half as wide from 65 rows on: its
    unpacked [BLOCK_K, BLOCK_N] block and the per-group partial product live in registers beside the accumulator.
    fp32 x (the "ieee" dot) halves the stages for shared memory. Only the FP8 few-row tile was tuned on a GPU (below);
    benchmarks/bench_qmatmul.py times every M against cuBLAS."""
    int4 = group != 0
    block_k = int4_block_k(group) if int4 else 128
    assert block_k is not None, f"no INT4 GEMM for group {group}"
    if rows <= 16:
        # FP8: K blocks of 256 and 6 stages, from benchmarks/probe_qgemv.py --gemm-sweep 4 on an H200 (docs/
        # benchmarks/probe_gemm_sweep_m4_h200.json): Llama-8B's four projections at 4 rows took 123 µs a layer
        # against 148 for the K block of 128 at 4 stages (bf16 cuBLAS 118). INT4: 16 columns at 2 warps, from
        # --gemm-sweep 16 --formats int4 (docs/benchmarks/probe_gemm_sweep_m16_int4_h200.json): 173 µs a layer at
        # 16 rows against 219 for (32 columns, 4 warps), bf16 120; at 4 rows the two were within 4% (221 / 212,
        # two calls on one H200: docs/benchmarks/qmatmul_few_rows_nvidia_h200.json, qmatmul_nvidia_h200.json).
        cfg = GemmConfig(16, 16, block_k, 2, 4) if int4 else GemmConfig(16, 32, 256, 4, 6)
    elif rows <= 64:
        cfg = GemmConfig(32 if rows <= 32 else 64, 64, block_k, 4, 4)
    elif rows <= 256:
        cfg = GemmConfig(64, 64, block_k, 4, 3) if int4 else GemmConfig(64, 128, 64, 4, 3)
    else:
        cfg = GemmConfig(128, 64, block_k, 8, 3) if int4 else GemmConfig(128, 128, 64, 8, 3)
    if dtype == torch.float32:
        cfg = GemmConfig(min(cfg.block_m, 64), cfg.block_n, cfg.block_k, cfg.num_warps, 2)
    return cfg


def fp8_dot_config(rows: int, n: int) -> GemmConfig:
    """The tile of the W8A8 GEMM on FP8 tensor cores (`qgemm` of FP8 codes on CUDA): 16-row tiles up to 16 rows
    (mma.sync on the codes widened to fp16, exact), else 64 or 128 rows (one or two warpgroups of FP8 wgmma);
    columns narrowed to 32 when 64-column tiles would leave most of an H200's 132 SMs idle; K blocks of 128 (each
    block's FP8 accumulation promoted to fp32, `_qgemm`). The dispatch takes it below SCALED_MM_MIN_ROWS rows."""
    block_m = 16 if rows <= 16 else 64 if rows <= 64 else 128
    block_n = 64 if triton.cdiv(rows, block_m) * triton.cdiv(n, 64) >= 132 else 32
    return GemmConfig(block_m, block_n, 128, 8 if block_m == 128 else 4, 4)


def gemm_supported(w: PackedQWeight) -> bool:
    """Whether `qgemm` takes this weight: FP8 always; INT4/UINT4 when its group makes an INT4 K block."""
    return w.fp8 or int4_block_k(w.group) is not None


def qgemm(x: torch.Tensor, w: PackedQWeight, *, row_scale: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (K contiguous; a float dtype, or float8_e4m3fn codes with row_scale) times the packed weight →
    a new [M, N] in out_dtype (default x's dtype). row_scale: [M] fp32, multiplied into each row (the activation's
    FP8 scale). The tl.dot runs in out_dtype when x is FP8 codes (exact), else in x's dtype (fp32 on the CPU)."""
    if x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1 or x.device != w.data.device:
        raise ValueError(f"qgemm needs x [M, {w.k}] with K contiguous on the weight's device; got "
                         f"{tuple(x.shape)} {x.stride()} on {x.device}")
    codes = x.dtype == torch.float8_e4m3fn
    out_dtype = out_dtype or x.dtype
    dot_dtype = out_dtype if codes else x.dtype
    if x.device.type == "cpu":  # the Triton interpreter: its bf16/fp16 tl.dot is wrong (3.9); fp32 holds them exactly
        dot_dtype = torch.float32
    fp8_dot = codes and w.fp8 and x.is_cuda and _capability(_device_index(x)) >= (8, 9)
    if dot_dtype not in TL_DTYPES or out_dtype not in TL_DTYPES or codes != (row_scale is not None):
        raise ValueError(f"qgemm needs float x, or FP8 codes with a row scale and a float out_dtype; got {x.dtype}, "
                         f"out_dtype {out_dtype}, row_scale {'given' if row_scale is not None else 'none'}")
    if not gemm_supported(w):
        raise ValueError(f"qgemm has no K block for INT4 group {w.group} (needs 16 <= block <= {MAX_INT4_BLOCK_K})")
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=out_dtype, device=x.device)
    if m == 0 or w.n == 0:
        return y
    if w.k == 0:
        return y.zero_()
    cfg = config or (fp8_dot_config(m, w.n) if fp8_dot else gemm_config(m, w.group, dot_dtype))
    if not w.fp8 and (cfg.block_k < w.group // 8 or w.group % cfg.block_k):
        raise ValueError(f"qgemm's INT4 K block must divide the group {w.group} and cover G/8; got {cfg.block_k}")
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n),)
    zero = w.zero if w.zero is not None else w.scale  # not read when ZERO >= 0
    xs = row_scale if row_scale is not None else w.scale  # not read without ROW_SCALE
    launcher.launch(_qgemm, grid, x.view(torch.uint8) if codes else x, w.data, w.scale, zero, xs, y, m, w.n, w.k,
                    x.stride(0), w.data.stride(0), w.scale.stride(0) if not w.fp8 else 0, y.stride(0),
                    INT4=not w.fp8, GROUP=w.group, ZERO=-1 if w.zero is not None else w.zero_const, X_FP8=codes,
                    ROW_SCALE=row_scale is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m, FOLD_SCALE=cfg.fold_scale, FP8_DOT=fp8_dot,
                    DOT_DTYPE=tl.float8e4nv if fp8_dot else TL_DTYPES[dot_dtype],
                    DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32", OUT_DTYPE=TL_DTYPES[out_dtype],
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


# Weight-only steps of at least this many rows dequantize the whole weight to x's dtype (`dequantize_weight`, one
# memory-bound pass) and run cuBLAS on it (`dequant_mm`), instead of the Triton GEMM, whose in-register
# dequantization costs more than the weight's bytes save once M is large: on an H200 (docs/benchmarks/
# qmatmul_nvidia_h200.json) Llama-8B's gate/up at 2048 rows took 2856 µs through the INT4 Triton GEMM and 1418
# through the FP8 one, against 603 for bf16 cuBLAS. benchmarks/bench_qmatmul.py times both paths at every M.
DEQUANT_MM_MIN_ROWS = 128


@triton.jit
def _dequantize_weight(W, S, Z, OUT, N, K, stride_wn, stride_sn, stride_on, INT4: tl.constexpr, GROUP: tl.constexpr,
                       ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Program (i, j): columns i·BLOCK_N.. and K values j·BLOCK_K.. of the packed weight → OUT [N, K] (K contiguous)
    in OUT_DTYPE: (q − z) · s computed in fp32 (packing.py `dequantize_packed`'s values, bit for bit) and rounded
    once. INT4: BLOCK_K is whole groups; each of a word's eight nibble planes is a run of G/8 values (packing.py)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    if INT4:
        WORDS: tl.constexpr = GROUP // 8
        TILE_GROUPS: tl.constexpr = BLOCK_K // GROUP
        offs_g = tl.program_id(1) * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
        offs_j = tl.arange(0, WORDS)
        ok = n_ok[:, None] & (offs_g < K // GROUP)[None, :]  # [BLOCK_N, TILE_GROUPS]
        words = tl.load(W + rows[:, None, None] * stride_wn + offs_g[None, :, None] * WORDS + offs_j[None, None, :],
                        mask=ok[:, :, None], other=0).to(tl.uint32, bitcast=True)
        s_off = rows[:, None] * stride_sn + offs_g[None, :]
        s = tl.load(S + s_off, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        if ZERO >= 0:
            z = ZERO * 1.0
        else:
            z = tl.load(Z + s_off, mask=ok, other=0).to(tl.float32)[:, :, None]
        out = OUT + rows[:, None, None] * stride_on + offs_g[None, :, None] * GROUP + offs_j[None, None, :]
        for p in tl.static_range(8):
            u = ((words >> (4 * p)) & 15).to(tl.float32)
            tl.store(out + p * WORDS, _to_out((u - z) * s, OUT_DTYPE), mask=ok[:, :, None])
    else:
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (offs_k < K)[None, :]
        codes = tl.load(W + rows[:, None] * stride_wn + offs_k[None, :], mask=ok, other=0)
        s = tl.load(S + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
        tl.store(OUT + rows[:, None] * stride_on + offs_k[None, :], _to_out(w, OUT_DTYPE), mask=ok)


@triton.jit
def _to_out(v, OUT_DTYPE: tl.constexpr):
    """fp32 v (finite) → OUT_DTYPE, rounded to nearest even. bf16: rounded in integer bits first, so the conversion
    is exact (Triton's interpreter, 3.9, truncates fp32 → bf16; compiled kernels round to nearest even either way)."""
    if OUT_DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = bits.to(tl.float32, bitcast=True)
    return v.to(OUT_DTYPE)


DEQUANT_BLOCK = (16, 512)  # (columns, K values) one program of `_dequantize_weight` writes (INT4: K whole groups)


def dequantize_weight(w: PackedQWeight, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight dequantized → a new [N, K] in `dtype` (nn.Linear's layout, what F.linear takes): each
    value (q − z) · s in fp32, rounded once to dtype, which is what an ONNX DequantizeLinear whose scale has the
    plan's dtype computes; in fp32 the values equal `dequantize_packed` bit for bit. One Triton launch."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"dequantize_weight writes a float dtype; got {dtype}")
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.data.device)
    if w.n == 0 or w.k == 0:
        return out
    block_n, block_k = DEQUANT_BLOCK
    if not w.fp8:
        block_k = max(block_k, w.group)
    grid = (triton.cdiv(w.n, block_n), triton.cdiv(w.k, block_k))
    zero = w.zero if w.zero is not None else w.scale  # not read when ZERO >= 0
    launcher.launch(_dequantize_weight, grid, w.data, w.scale, zero, out, w.n, w.k, w.data.stride(0),
                    w.scale.stride(0) if not w.fp8 else 0, out.stride(0), INT4=not w.fp8, GROUP=w.group,
                    ZERO=-1 if w.zero is not None else w.zero_const, BLOCK_N=block_n, BLOCK_K=block_k,
                    OUT_DTYPE=TL_DTYPES[dtype], num_warps=4)
    return out


def dequant_mm(x: torch.Tensor, w: PackedQWeight) -> torch.Tensor:
    """x [M, K] (bf16/fp16) times the packed weight, weight-only: `dequantize_weight` into a transient [N, K] of x's
    dtype (from torch's caching allocator: the next layer's call reuses the block; the CUDA graph pool during
    capture), then cuBLAS (F.linear, fp32 accumulation) → a new [M, N] in x's dtype. For large M (prefill), where
    the bf16 GEMM is compute-bound and the extra write and read of the weight cost less than dequantizing it in the
    GEMM's inner loop."""
    return torch.nn.functional.linear(x, dequantize_weight(w, x.dtype))


@triton.jit
def _quantize_fp8_rows(X, S, Q, RS, K, stride_xm, stride_s, stride_qm, MIN_SCALE, BLOCK_K: tl.constexpr,
                       DEQUANT: tl.constexpr, DYNAMIC: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """Program r: row r of x [M, K] under its scale S[r · stride_s] (stride 0: one static scale): ONNX
    QuantizeLinear to FP8 E4M3 (x / s rounded to nearest even, saturating at ±448; the division correctly rounded,
    as torch's) → Q's row as the codes' bytes, or (DEQUANT) as the DequantizeLinear's fp32 values; RS[r] = s.
    DYNAMIC: S is not read; s is the per-token scale the quantizer's graph computes (quantize/qdq.py
    `write_dynamic_fp8`), max(max|x| / 448, MIN_SCALE) with the division rounded to SCALE_DTYPE (the graph's dtype).
    A row of at most BLOCK_K values is read once and kept in registers (one memory round trip: the launch is
    latency-bound, `quantize_launch_config`); longer rows are read in BLOCK_K slices, twice when DYNAMIC."""
    row = tl.program_id(0)
    x_row = X + row * stride_xm
    if K <= BLOCK_K:
        offs = tl.arange(0, BLOCK_K)
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        s = _row_fp8_scale(S, row, stride_s, tl.abs(x), MIN_SCALE, DYNAMIC, SCALE_DTYPE)
        tl.store(RS + row, s)
        _store_fp8_codes(Q + row * stride_qm + offs, x, s, ok, DEQUANT)
    else:
        big = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if DYNAMIC:
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                big = tl.maximum(big, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        s = _row_fp8_scale(S, row, stride_s, big, MIN_SCALE, DYNAMIC, SCALE_DTYPE)
        tl.store(RS + row, s)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            ok = offs < K
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            _store_fp8_codes(Q + row * stride_qm + offs, x, s, ok, DEQUANT)


@triton.jit
def _row_fp8_scale(S, row, stride_s, abs_x, MIN_SCALE, DYNAMIC: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """The row's activation scale, fp32: DYNAMIC, `dynamic_fp8_scale` of abs_x (|x| over the row, or a running
    elementwise max of it); else S[row · stride_s]."""
    if DYNAMIC:
        return dynamic_fp8_scale(abs_x, MIN_SCALE, SCALE_DTYPE)
    return tl.load(S + row * stride_s).to(tl.float32)


@triton.jit
def dynamic_fp8_scale(abs_x, MIN_SCALE, SCALE_DTYPE: tl.constexpr):
    """A row's per-token FP8 scale (`DynamicScale`'s formula) as fp32: max(max(abs_x) / 448 with the division
    rounded to SCALE_DTYPE, MIN_SCALE)."""
    ratio = _to_out(tl.math.div_rn(tl.max(abs_x, axis=0), FP8_MAX_TL), SCALE_DTYPE).to(tl.float32)
    return tl.maximum(ratio, MIN_SCALE)


@triton.jit
def quantize_row_fp8(q_ptr, rs_ptr, x, ok, S, MIN_SCALE, DYNAMIC: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """One whole row x (fp32, positions past ok zero) under its dynamic per-token scale (DYNAMIC) or the static
    per-tensor one at S: the codes' bytes at q_ptr, the scale at rs_ptr. What `_quantize_fp8_rows` does to a row it
    holds in registers, for kernels that produce the row (the FP8 forms of the RMSNorm and gated-MLP kernels:
    plugins/rms_norm/kernel.py and its neighbours)."""
    s = _row_fp8_scale(S, 0, 0, tl.abs(x), MIN_SCALE, DYNAMIC, SCALE_DTYPE)
    tl.store(rs_ptr, s)
    _store_fp8_codes(q_ptr, x, s, ok, False)


def static_scale_arg(act_scale: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The S argument of a kernel calling `quantize_row_fp8`: a static per-tensor activation scale as one fp32
    value, or (dynamic: act_scale None) `placeholder`, which the kernel does not read."""
    if act_scale is None:
        return placeholder
    if act_scale.numel() != 1:
        raise ValueError(f"a static FP8 activation scale is per tensor (one value); got shape {tuple(act_scale.shape)}")
    return act_scale.reshape(1).float()


def activation_fp8(y: torch.Tensor, act_scale: torch.Tensor | None,
                   min_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(codes, row scale, y's dtype) of y [..., K] by the quantize launch: under the static scale act_scale, or the
    dynamic per-token one (act_scale None; `DynamicScale(y.dtype, min_scale)`). What the FP8 forms of the producer
    kernels give, for the inputs they do not take (rows too long, a broadcasting add)."""
    rows = y.reshape(-1, y.shape[-1]).contiguous()
    codes, row_scale = quantize_fp8_rows(rows, act_scale, None if act_scale is not None
                                         else DynamicScale(y.dtype, min_scale))
    return codes.reshape(y.shape), row_scale, y.dtype


@triton.jit
def _store_fp8_codes(q_ptr, x, s, ok, DEQUANT: tl.constexpr):
    """x / s rounded to E4M3 (saturating) → its code bytes at q_ptr, or (DEQUANT) the code's value · s in fp32."""
    q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX_TL), FP8_MAX_TL))
    if DEQUANT:
        tl.store(q_ptr, q * s, mask=ok)
    else:
        tl.store(q_ptr, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=ok)


@triton.jit
def _round_e4m3(v):
    """fp32 v with |v| <= 448 → the nearest FP8 E4M3 value (ties to even), as fp32. The rounding is done in fp32
    arithmetic, so the conversion to float8e4nv after it is exact: Triton's interpreter (3.9) rounds -31.68 to -16
    when it converts directly (the carry into the exponent is lost). For |v| in [2^e, 2^(e+1)) E4M3 keeps steps of
    2^(e-3) (below 2^-6 the subnormal step 2^-9); adding and subtracting m = 1.5 · 2^(e+20), whose fp32 ulp is that
    step, rounds |v| to it to nearest even (an even multiple of the step is an even mantissa), and the sign comes
    back bit for bit (−0 stays −0)."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    e = tl.maximum((bits >> 23) & 255, 121)  # biased exponent, at least 127 - 6's
    magic = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


FP8_MAX_TL = tl.constexpr(FP8_MAX)
# Rows of up to this many values are read once and quantized from registers by `_quantize_fp8_rows`; longer rows
# are read in slices of this size. A power of two.
QUANTIZE_BLOCK_K = 16384


def quantize_launch_config(k: int, max_block: int = QUANTIZE_BLOCK_K) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of `_quantize_fp8_rows` for rows of k values: the whole row in one block up to
    max_block (a power of two; longer rows are read in slices of it), 8 values a thread (16 at the longest rows, 32 warps). One program a row has the latency of
    its per-thread chain (a correctly rounded division and the E4M3 rounding a value), so the values a thread
    holds set the launch's time: at 32 a thread a step's quantize launches took 13% of a W8A8 workload's kernel time
    (torch.profiler, gpu_e2e.py --only quant on an H200). The launch moves a few KB a row and is bound by the latency
    of its dependent memory round trips, not by bandwidth: the first version read a row in slices of 1024 values,
    twice for a dynamic scale (8 round trips at K = 4096), and cost 3-4.5 us beside _scaled_mm's 14 us on Llama-8B's
    projections at 64-256 rows on an H200 (docs/benchmarks/qmatmul_nvidia_h200.json: fp8_w8a8 against scaled_mm)."""
    block_k = min(max_block, triton.next_power_of_2(max(k, 16)))
    return block_k, max(1, min(32, block_k // (32 * 8)))


def _row_scales(act_scale: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    """The activation's scale ([] static, or one per row) as fp32 values and the stride between rows' scales."""
    scale = act_scale.reshape(-1)
    if scale.dtype != torch.float32:
        scale = scale.float()
    assert scale.numel() in (1, m), (tuple(act_scale.shape), m)
    return scale, 0 if scale.numel() == 1 else scale.stride(0)


@dataclass(frozen=True)
class DynamicScale:
    """A per-token activation scale the kernels compute themselves instead of reading it: the quantizer's graph
    max(ReduceMax(Abs(x), -1) / 448, min_scale) (quantize/qdq.py `write_dynamic_fp8`) in `dtype` (the graph's, x's).
    runtime/executors/qmatmul_packing.py passes one where it finds that subgraph feeding a QMatMul, and drops the
    subgraph's four kernels a projection."""

    dtype: torch.dtype
    min_scale: float

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The graph's scale [..., 1] in `dtype`, by the graph's torch ops."""
        amax = x.to(self.dtype).abs().amax(-1, keepdim=True)
        return torch.maximum(amax / torch.tensor(FP8_MAX, dtype=self.dtype, device=x.device),
                             torch.tensor(self.min_scale, dtype=self.dtype, device=x.device))


def _launch_quantize(x: torch.Tensor, act_scale: torch.Tensor | None, dequant: bool,
                     dynamic: DynamicScale | None = None,
                     max_block: int = QUANTIZE_BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    assert x.stride(1) == 1 or k <= 1, x.stride()
    assert (act_scale is None) == (dynamic is not None), "an activation scale, or a DynamicScale to compute it"
    out = torch.empty(m, k, dtype=torch.float32 if dequant else torch.uint8, device=x.device)
    row_scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    scale, stride_s = _row_scales(act_scale, m) if dynamic is None else (row_scale, 0)  # not read when DYNAMIC
    if m:
        block_k, warps = quantize_launch_config(k, max_block)
        launcher.launch(_quantize_fp8_rows, (m,), x, scale, out, row_scale, k, x.stride(0), stride_s, out.stride(0),
                        dynamic.min_scale if dynamic else 0.0, BLOCK_K=block_k, DEQUANT=dequant,
                        DYNAMIC=dynamic is not None,
                        SCALE_DTYPE=TL_DTYPES[dynamic.dtype] if dynamic else tl.float32, num_warps=warps)
    return out, row_scale


def quantize_fp8_rows(x: torch.Tensor, act_scale: torch.Tensor | None, dynamic: DynamicScale | None = None, *,
                      max_block: int = QUANTIZE_BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] float8_e4m3fn, row scale [M, 1] fp32 contiguous) of x [M, K] (K contiguous) under the
    activation's scale ([] static, or one per row; or None with `dynamic`, computed in the same launch): ONNX
    QuantizeLinear's codes (reference.py `fake_quantize_fp8` before its DQ), in one Triton launch. In torch the same
    took five kernels plus the scale's expansion: 23 µs at two rows of K = 4096 on an H200 (docs/benchmarks/
    qmatmul_nvidia_h200.json, fp8_w8a8 against scaled_mm), more than the FP8 GEMM it feeds. max_block: rows longer
    than this many values are read in slices (`quantize_launch_config`)."""
    codes, row_scale = _launch_quantize(x, act_scale, dequant=False, dynamic=dynamic, max_block=max_block)
    return codes.view(torch.float8_e4m3fn), row_scale


def fake_quantize_fp8_rows(x: torch.Tensor, act_scale: torch.Tensor | None, dynamic: DynamicScale | None = None, *,
                           max_block: int = QUANTIZE_BLOCK_K) -> torch.Tensor:
    """reference.py `fake_quantize_fp8(x.float(), scale)` of x [M, K] (K contiguous) under the activation's scale
    ([] static, or one per row; or None with `dynamic`) → a new fp32 [M, K], in one Triton launch (the GEMV's W8A8
    input). max_block: as for `quantize_fp8_rows`."""
    return _launch_quantize(x, act_scale, dequant=True, dynamic=dynamic, max_block=max_block)[0]


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def scaled_mm_supported(x: torch.Tensor, w: PackedQWeight, out_dtype: torch.dtype | None = None) -> bool:
    """Whether `fp8_scaled_mm` takes this step: an FP8 weight, a bf16 result (out_dtype, default x's dtype: x may be
    the FP8 codes already) on CUDA with compute capability >= 9.0 (cuBLASLt FP8 with rowwise scales), K and N
    multiples of 16 (_scaled_mm's shape rule)."""
    return (w.fp8 and x.is_cuda and (out_dtype or x.dtype) == torch.bfloat16 and w.k % 16 == 0 and w.n % 16 == 0
            and _capability(_device_index(x)) >= (9, 0))


def fp8_scaled_mm(codes: torch.Tensor, w: PackedQWeight, row_scale: torch.Tensor) -> torch.Tensor:
    """codes [M, K] float8_e4m3fn (row-major) times the packed FP8 weight, scaled per row (row_scale [M, 1] fp32) and
    per column (the packed scale) → a new [M, N] bf16, through torch._scaled_mm."""
    assert w.fp8 and w.scale.dtype == torch.float32, (w.group, w.scale.dtype)
    weight = w.data.view(torch.float8_e4m3fn).t()  # [K, N], column-major: the [N, K] bytes as they are
    return torch._scaled_mm(codes, weight, scale_a=row_scale, scale_b=w.scale.view(1, w.n), out_dtype=torch.bfloat16,
                            use_fast_accum=False)
