"""Probe: where the quantized decode GEMVs lose their time, and which kernel shapes win it back (issue 32).

quant_e2e on an H200 measured the 8B shape's batch-1 projections at 1.0-1.5 TB/s for INT4 (kernel_half2.py) and
1.9-2.3 TB/s for FP8 on the three smaller projections (kernel.py `_qgemv_fp8`), against 3.0-4.1 TB/s for bf16.
This script times candidate kernels side by side on the same weights (CUDA graphs over weight copies twice the L2,
as bench_qmatmul.py does), each checked against x @ the dequantized weight first:

- ``bf16``: the executor's bf16 projection (runtime/executors/gemv.py), the baseline;
- ``fp8``: kernel.py's FP8 GEMV (fp32 math), ``fp8_h2_*``: `_fp8_half2` below, FP8 weights in packed half2
  arithmetic (cvt.rn.f16x2.e4m3x2, fma.rn.f16x2), at a few (BLOCK_N, BLOCK_K, warps) configs;
- ``int4``: kernel_half2.py's GEMV as shipped, ``int4_pf``: the same with the first weight tile's loads issued
  before the row-scale prologue, ``int4_noscale``: no prologue at all (x taken as is: right only for |x| small
  enough that fp16 holds the products, as the random x here is; a bound on what the prologue costs),
  ``int4_splitk{S}``: S programs a column block, each 1/S of K, fp32 atomics into a zeroed buffer then a cast
  (the memset and the cast are timed too).

``--xp-sweep M`` times kernel_half2.py's `_qgemv_int4_xp` (qgemv(variant="half2_xp"): x packed to half2 once by
its own launch, a run-time K loop) at M rows over `xp_configs`, beside ``int4`` (the half2 GEMV), ``bf16`` and
``pack_x`` (the x launch alone, which the variant's times include).

``--ncu`` instead runs each variant a few times eagerly so `ncu` can profile one launch of each.

    python benchmarks/probe_qgemv.py --out docs/benchmarks/probe_qgemv_h200.json
    python benchmarks/probe_qgemv.py --xp-sweep 1 --out docs/benchmarks/probe_qgemv_xp_h200.json
    TRITON_INTERPRET=1 python benchmarks/probe_qgemv.py --smoke     # tiny shapes on the CPU (checks only)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qmatmul import clone_packed, copies_for, time_calls  # noqa: E402

from trtopt.plugins.qmatmul.kernel_half2 import (F16_1024, F16_MINUS_64, _dequant, _dot8, _pack, _pair,  # noqa: E402
                                                 ROW_SCALE_TOP, _row_scale, _x_half2, load_int4_tile,
                                                 x_chunk)

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
SMOKE_SHAPES = [("tiny", 256, 24), ("tiny_down", 512, 20)]
FP8_CONFIGS = [(8, 1024, 2), (8, 2048, 4), (4, 1024, 2), (8, 512, 1), (4, 2048, 4)]
SMOKE_FP8_CONFIGS = [(4, 64, 1)]


@triton.jit
def _e4m3_half2(b, ASM: tl.constexpr):
    """int32 word of four e4m3 bytes → int32 half2 bits of (byte 0, byte 1) and (byte 2, byte 3)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }
            """,
            constraints="=r,=r,r", args=[b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        bu = b.to(tl.uint32, bitcast=True)
        v0 = (bu & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v1 = ((bu >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v2 = ((bu >> 16) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v3 = ((bu >> 24) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return _pair(v0, v1), _pair(v2, v3)


FP8_ROW_SCALE_TOP = tl.constexpr(4)  # a row's largest |x| · 2^e in [16, 32): 448 · 32 · 4 < 65504 (e4m3 weights)


@triton.jit
def _fp8_half2(X, W, S, Y, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               K_TILES: tl.constexpr, X_CHUNK: tl.constexpr, OUT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """One row of x against FP8 [N, K] bytes read as int32 words (K % 4 == 0). A tile is two halves of BLOCK_K / 8
    words a column; word j of half A pairs with word j of half B in one _dot8 (eight products, fp16 lanes of
    four)."""
    HW: tl.constexpr = BLOCK_K // 8
    WORDS: tl.constexpr = K // 4
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_w = tl.arange(0, HW)
    acc = tl.zeros((BLOCK_N, HW), dtype=tl.float32)
    up, down = _row_scale(X, K, K, X_CHUNK, FP8_ROW_SCALE_TOP)
    for t in tl.static_range(K_TILES):
        wa = t * 2 * HW + offs_w
        wb = wa + HW
        a_ok = wa < WORDS
        b_ok = wb < WORDS
        a = tl.load(W + safe_n[:, None] * stride_wn + wa[None, :], mask=a_ok[None, :], other=0)
        b = tl.load(W + safe_n[:, None] * stride_wn + wb[None, :], mask=b_ok[None, :], other=0)
        a01, a23 = _e4m3_half2(a, ASM)
        b01, b23 = _e4m3_half2(b, ASM)
        xa = X + 4 * wa[None, :]
        xb = X + 4 * wb[None, :]
        xa01 = _pack(tl.load(xa, mask=a_ok[None, :], other=0.0).to(tl.float32) * up,
                     tl.load(xa + 1, mask=a_ok[None, :], other=0.0).to(tl.float32) * up, ASM)
        xa23 = _pack(tl.load(xa + 2, mask=a_ok[None, :], other=0.0).to(tl.float32) * up,
                     tl.load(xa + 3, mask=a_ok[None, :], other=0.0).to(tl.float32) * up, ASM)
        xb01 = _pack(tl.load(xb, mask=b_ok[None, :], other=0.0).to(tl.float32) * up,
                     tl.load(xb + 1, mask=b_ok[None, :], other=0.0).to(tl.float32) * up, ASM)
        xb23 = _pack(tl.load(xb + 2, mask=b_ok[None, :], other=0.0).to(tl.float32) * up,
                     tl.load(xb + 3, mask=b_ok[None, :], other=0.0).to(tl.float32) * up, ASM)
        acc += _dot8(a01, a23, b01, b23, xa01, xa23, xb01, xb23, ASM)
    scale = tl.load(S + safe_n).to(tl.float32)
    tl.store(Y + offs_n, (tl.sum(acc, axis=1) * down * scale).to(OUT_DTYPE), mask=n_ok)


@triton.jit
def _int4_probe(X, W, S, Y, N, stride_wn, stride_sn, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                GROUPS: tl.constexpr, TILE_GROUPS: tl.constexpr, K_TILES: tl.constexpr, SPLIT: tl.constexpr,
                ZERO: tl.constexpr, X_CHUNK: tl.constexpr, OUT_DTYPE: tl.constexpr, ASM: tl.constexpr,
                PREFETCH: tl.constexpr, ROW_SCALE: tl.constexpr):
    """kernel_half2 `_qgemv_int4_half2` at one row with a uniform zero point, plus the probe's knobs: PREFETCH
    (tile 0's weights loaded before the row scale), ROW_SCALE=False (no prologue; x as is), SPLIT > 1 (program
    pid // SPLIT's columns over K tiles [(pid % SPLIT)·K_TILES, +K_TILES), fp32 atomics into Y)."""
    WORDS: tl.constexpr = GROUP // 8
    K: tl.constexpr = GROUPS * GROUP
    pid = tl.program_id(0)
    part_k = pid % SPLIT
    offs_n = (pid // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_j = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    t0 = part_k * K_TILES
    if PREFETCH:
        b0, s0, g0, ok0, so0 = load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t0, TILE_GROUPS, GROUPS,
                                               WORDS)
    if ROW_SCALE:
        up, down = _row_scale(X, K, K, X_CHUNK, ROW_SCALE_TOP)
    else:
        up = 1.0
        down = 1.0
    zlo = tl.full((BLOCK_N, TILE_GROUPS, 1), (F16_1024 + ZERO) * 65537, tl.int32)
    zhi = tl.full((BLOCK_N, TILE_GROUPS, 1), (F16_MINUS_64 + 16 * ZERO) * 65537 - 2**32, tl.int32)
    for i in tl.static_range(K_TILES):
        if PREFETCH and i == 0:
            b, s, offs_g, g_ok = b0, s0, g0, ok0
        else:
            b, s, offs_g, g_ok, s_off = load_int4_tile(W, S, safe_n, offs_j, stride_wn, stride_sn, t0 + i,
                                                       TILE_GROUPS, GROUPS, WORDS)
        w0, w1, w2, w3 = _dequant(b, zlo, zhi, ASM)
        x_off = (offs_g[:, None] * GROUP + offs_j[None, :])[None, :, :]
        x_ok = offs_g[None, :, None] < GROUPS
        x0, x1, x2, x3 = _x_half2(X, x_off, x_ok, up, WORDS, ASM)
        acc += _dot8(w0, w1, w2, w3, x0, x1, x2, x3, ASM) * s[:, :, None]
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * down
    if SPLIT == 1:
        tl.store(Y + offs_n, y.to(OUT_DTYPE), mask=n_ok)
    else:
        tl.atomic_add(Y + offs_n, y, mask=n_ok, sem="relaxed")


def fp8_half2(x, w, config):
    block_n, block_k, warps = config
    y = torch.empty(1, w.n, dtype=x.dtype, device=x.device)
    words = w.data.view(torch.int32)
    tiles = -(-w.k // block_k)
    _fp8_half2[(triton.cdiv(w.n, block_n),)](
        x, words, w.scale, y, w.n, words.stride(0), K=w.k, BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=tiles,
        X_CHUNK=x_chunk(w.k), OUT_DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32,
        ASM=x.device.type == "cuda", num_warps=warps)
    return y


def int4_probe(x, w, *, prefetch=False, row_scale=True, split=1, config=(8, 2048, 2)):
    block_n, tile_k, warps = config
    groups = w.k // w.group
    tile_groups = tile_k // w.group
    tiles = -(-groups // tile_groups)
    assert tiles % split == 0, (tiles, split)
    cuda = x.device.type == "cuda"
    out_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32
    y = torch.zeros(1, w.n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(1, w.n, dtype=x.dtype, device=x.device)
    _int4_probe[(triton.cdiv(w.n, block_n) * split,)](
        x, w.data, w.scale, y, w.n, w.data.stride(0), w.scale.stride(0), BLOCK_N=block_n, GROUP=w.group,
        GROUPS=groups, TILE_GROUPS=tile_groups, K_TILES=tiles // split, SPLIT=split, ZERO=w.zero_const,
        X_CHUNK=x_chunk(w.k), OUT_DTYPE=out_dtype, ASM=cuda, PREFETCH=prefetch, ROW_SCALE=row_scale,
        num_warps=warps)
    return y.to(x.dtype) if split > 1 else y


def make(k, n, group, device, gen):
    from trtopt.plugins.qmatmul.packing import pack_weight

    bf16 = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    codes = (torch.randn(k, n, device=device, generator=gen) * 64).to(torch.float8_e4m3fn)
    scale = (torch.rand(n, device=device, generator=gen) * 1e-3 + 1e-4).to(torch.bfloat16)
    fp8 = pack_weight(codes, scale, torch.zeros(n, device=device).to(torch.float8_e4m3fn), block_size=0)
    q = torch.randint(-8, 8, (k, n), device=device, generator=gen, dtype=torch.int8)
    s4 = ((torch.rand(k // group, n, device=device, generator=gen) + 0.5) / (8 * math.sqrt(k))).to(torch.bfloat16)
    int4 = pack_weight(q, s4, torch.zeros(k // group, n, device=device, dtype=torch.int8), block_size=group)
    return {"bf16": bf16, "fp8": fp8, "int4": int4}


def sweep_configs(fmt: str, k: int, smoke: bool) -> list[tuple[int, int, int]]:
    """(BLOCK_N, K values a tile, warps) for qgemv: FP8 at 4-128 values a thread, INT4 at 16-256 (whole groups,
    tiles dividing K or covering it)."""
    if smoke:
        return [(2, 64, 1), (4, 128, 2)]
    out = []
    for bn in (1, 2, 4, 8):
        for tile in (512, 1024, 2048, 4096):
            for warps in (1, 2, 4, 8):
                per_thread = bn * tile / (32 * warps)
                if fmt == "fp8" and 4 <= per_thread <= 128 and bn <= 4 and warps >= 2:
                    out.append((bn, tile, warps))
                if fmt == "int4" and 16 <= per_thread <= 256 and tile <= 2048:
                    out.append((bn, tile, warps))
    return out


def gemm_configs(fmt: str, smoke: bool, rows: int = 16):
    """gemm.GemmConfigs for a few-row GEMM: 16-row tiles, 16-64 columns, 2 or 4 warps, 4 or 6 stages (FP8 also
    K blocks of 256; INT4's K block is its group's). Above 16 rows: row tiles of min(rows, 64) (and 128 from 128
    rows), 32-128 columns, 4 or 8 warps, 3 or 4 stages."""
    from trtopt.plugins.qmatmul.gemm import GemmConfig

    if smoke:
        return [GemmConfig(16, 16, 32 if fmt == "int4" else 64, 2, 2)]
    if rows > 16:
        block_ks = (64, 128, 256) if fmt == "fp8" else (128,)
        configs = [GemmConfig(min(rows, 64), bn, bk, w, st) for bn in (32, 64, 128) for bk in block_ks
                   for w in (4, 8) for st in (3, 4)]
        if rows >= 128:
            configs += [GemmConfig(128, bn, 128 if fmt == "int4" else 64, 8, st) for bn in (64, 128) for st in (3, 4)]
        return configs
    configs = [GemmConfig(16, bn, bk, w, st) for bn in (16, 32, 64) for bk in ((128, 256) if fmt == "fp8" else (128,))
               for w in (2, 4) for st in (4, 6)]
    if fmt == "int4":  # the unfolded scale order (gemm.py FOLD_SCALE off) at the few-row default tile, and wider tiles
        configs += [GemmConfig(16, 32, 128, 4, 4, fold_scale=False), GemmConfig(16, 128, 128, 4, 4),
                    GemmConfig(16, 64, 128, 4, 3), GemmConfig(32, 64, 128, 4, 4)]
    return configs


def xp_configs(smoke: bool, given: list[str] | None = None) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, K values a tile, warps, stages) for qgemv(variant="half2_xp"): 4 or 8 weight words a thread a tile,
    with and without the K loop's software pipeline; or the `given` ones ("BLOCK_N,TILE,WARPS,STAGES")."""
    if given:
        return [tuple(int(v) for v in c.split(",")) for c in given]
    if smoke:
        return [(4, 64, 1, 1), (8, 64, 2, 2)]
    shapes = [(4, 512, 2), (4, 512, 1), (4, 1024, 4), (4, 1024, 2), (8, 256, 2), (8, 512, 4), (8, 512, 2),
              (8, 1024, 8), (8, 1024, 4), (16, 256, 4), (16, 256, 2), (16, 512, 8), (16, 512, 4)]
    return [(bn, tile, w, st) for bn, tile, w in shapes for st in (1, 3)]


def xp_variants(smoke: bool, given: list[str] | None = None, fp8_given: list[str] | None = None) -> dict:
    from trtopt.plugins.qmatmul import kernel as qk
    from trtopt.runtime.executors.gemv import projection

    def pack_only(x, w):  # the x launch alone: what the variant adds over its GEMV
        return qk.pack_x_half2(x, w.group)[0]

    v = {"bf16": ("bf16", lambda x, w: projection(x, w)),
         "int4": ("int4", lambda x, w: qk.qgemv(x, w, variant="half2")),
         "int4_xp": ("int4", lambda x, w: qk.qgemv(x, w, variant="half2_xp")),  # default_config_xp
         "pack_x": ("int4", pack_only)}
    if fp8_given is not None:  # FP8's one-row GEMV at its default and at these (BLOCK_N, tile, warps, stages)
        v["fp8"] = ("fp8", lambda x, w: qk.qgemv(x, w))
        for cfg in [tuple(int(c) for c in g.split(",")) for g in fp8_given]:
            v["fp8_" + "_".join(map(str, cfg))] = ("fp8", lambda x, w, cfg=cfg: qk.qgemv(x, w, cfg))
    for cfg in xp_configs(smoke, given):
        v["int4_xp_" + "_".join(map(str, cfg))] = ("int4", lambda x, w, cfg=cfg: qk.qgemv(x, w, cfg,
                                                                                          variant="half2_xp"))
    return v


def variants(k, smoke, sweep=False, gemm_rows=0, formats=("fp8", "int4"), xp=False, xp_given=None,
             fp8_given=None):
    if xp:
        return xp_variants(smoke, xp_given, fp8_given)
    if gemm_rows:
        from trtopt.plugins.qmatmul.gemm import gemm_config, qgemm
        from trtopt.runtime.executors.gemv import projection

        v = {"bf16": ("bf16", lambda x, w: projection(x, w))}
        for fmt in formats:
            group = 0 if fmt == "fp8" else (32 if smoke else 128)
            default = gemm_config(gemm_rows, group, torch.bfloat16)
            for cfg in [None] + gemm_configs(fmt, smoke, gemm_rows):
                if cfg == default:
                    continue
                name = "default" if cfg is None else (f"{cfg.block_m}x{cfg.block_n}_{cfg.block_k}_{cfg.num_warps}_"
                                                      f"{cfg.num_stages}" + ("_exact" if cfg.fold_scale is False else ""))
                v[f"{fmt}_gemm_{name}"] = (fmt, lambda x, w, cfg=cfg: qgemm(x, w, config=cfg))
        return v
    if sweep:
        from trtopt.plugins.qmatmul.kernel import qgemv

        v = {}
        for fmt in ("fp8", "int4"):
            for cfg in sweep_configs(fmt, k, smoke):
                v[fmt + "_" + "_".join(map(str, cfg))] = (fmt, lambda x, w, cfg=cfg: qgemv(x, w, cfg))
        return v

    from trtopt.plugins.qmatmul.kernel import qgemv
    from trtopt.runtime.executors.gemv import projection

    v = {"bf16": ("bf16", lambda x, w: projection(x, w)),
         "fp8": ("fp8", lambda x, w: qgemv(x, w)),
         "int4": ("int4", lambda x, w: qgemv(x, w))}
    for cfg in (SMOKE_FP8_CONFIGS if smoke else FP8_CONFIGS):
        v["fp8_h2_" + "_".join(map(str, cfg))] = ("fp8", lambda x, w, cfg=cfg: fp8_half2(x, w, cfg))
    cfg = (4, 64, 1) if smoke else (8, 2048, 2)
    v["int4_pf"] = ("int4", lambda x, w: int4_probe(x, w, prefetch=True, config=cfg))
    v["int4_noscale"] = ("int4", lambda x, w: int4_probe(x, w, row_scale=False, config=cfg))
    v["int4_probe"] = ("int4", lambda x, w: int4_probe(x, w, config=cfg))
    for split in (2, 4) if not smoke else (2,):
        v[f"int4_splitk{split}"] = ("int4", lambda x, w, s=split: int4_probe(x, w, split=s, config=cfg))
    if not smoke:
        v["int4_pf_4_2048_2"] = ("int4", lambda x, w: int4_probe(x, w, prefetch=True, config=(4, 2048, 2)))
        v["int4_pf_8_4096_4"] = ("int4", lambda x, w: int4_probe(x, w, prefetch=True, config=(8, 4096, 4)))
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="run each variant 3 times eagerly (for ncu), no timing")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="time kernel.py's qgemv at the SWEEP configs instead")
    ap.add_argument("--gemm-sweep", type=int, default=0, metavar="M",
                    help="time gemm.py's qgemm (FP8 and INT4 weight-only) at M rows over GEMM_CONFIGS instead")
    ap.add_argument("--xp-sweep", type=int, default=0, metavar="M",
                    help="time qgemv(variant='half2_xp') at M rows over xp_configs, with half2, bf16 and the x launch")
    ap.add_argument("--xp-configs", nargs="*", default=None, metavar="BN,TILE,WARPS,STAGES",
                    help="--xp-sweep: these configs instead of xp_configs")
    ap.add_argument("--fp8-configs", nargs="*", default=None, metavar="BN,TILE,WARPS,STAGES",
                    help="--xp-sweep: also FP8's GEMV at its default and these configs (STAGES 0: tiles unrolled)")
    ap.add_argument("--formats", nargs="*", default=["fp8", "int4"], choices=["fp8", "int4"],
                    help="--gemm-sweep: the formats swept")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator(device).manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    group = 32 if args.smoke else 128
    t_start = time.time()
    rows = {}
    for name, k, n in shapes:
        ws = make(k, n, group, device, gen)
        from trtopt.plugins.qmatmul.packing import dequantize_packed

        want = {"bf16": None, "fp8": dequantize_packed(ws["fp8"]), "int4": dequantize_packed(ws["int4"])}
        rows_x = args.gemm_sweep or args.xp_sweep or 1
        x = torch.randn(rows_x, k, device=device, generator=gen).to(torch.bfloat16)
        copies = {f: [w] + [w.clone() if f == "bf16" else clone_packed(w) for _ in range(
            copies_for(w.numel() * 2 if f == "bf16" else w.nbytes, device) - 1)] for f, w in ws.items()}
        nbytes = {f: (w.numel() * 2 if f == "bf16" else w.nbytes) for f, w in ws.items()}
        row = {}
        for vname, (fmt, fn) in variants(k, args.smoke, args.sweep, args.gemm_sweep, args.formats,
                                               bool(args.xp_sweep), args.xp_configs,
                                               args.fp8_configs).items():
            if args.only and vname not in args.only:
                continue
            try:
                got = fn(x, ws[fmt]).float()
            except (AssertionError, ValueError, triton.runtime.errors.OutOfResources):  # a tile that does not fit
                continue
            ref = x.float() @ (ws["bf16"].float().t() if fmt == "bf16" else want[fmt])
            err = 0.0 if vname == "pack_x" else float((got - ref).abs().max() / ref.abs().max())
            if err > 2e-2:
                raise SystemExit(f"{vname} on {name} is wrong: max relative error {err:.2e}")
            if args.ncu:
                for _ in range(3):
                    fn(x, ws[fmt])
                torch.cuda.synchronize()
                continue
            s = time_calls(lambda i, fn=fn, fmt=fmt: fn(x, copies[fmt][i]), len(copies[fmt]), device)
            row[vname] = {"us": round(s * 1e6, 2), "GBps": round(nbytes[fmt] / s / 1e9), "err": float(f"{err:.1e}")}
            print(f"{name:8s} {vname:18s} {row[vname]['us']:8.2f} us {row[vname]['GBps']:6d} GB/s err {err:.1e}",
                  flush=True)
        rows[name] = {"K": k, "N": n, "bytes": nbytes, "variants": row}
        del copies, ws, want
        if args.out and not args.ncu:  # after every shape: a run cut short keeps the shapes it finished
            gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            args.out.write_text(json.dumps({"benchmark": "probe_qgemv", "machine": {"gpu": gpu,
                                            "torch": torch.__version__, "triton": triton.__version__},
                                            "M": rows_x, "int4_group": group, "shapes": rows,
                                            "wall_s": round(time.time() - t_start, 1)}, indent=1))


if __name__ == "__main__":
    main()
