"""PagedAttention's AOT entry point for TensorRT (face 5 of docs/architecture.md §4), with no `tensorrt` import:
testable here.

Why a separate entry kernel and not `attention._paged_attn_kernel` as is (the kernel author's notes, and TensorRT's
AOT contract in tensorrt/plugin/_plugin_class.py, `get_launch_params`):

1. **One launch.** aot_impl returns exactly one (kernel name, PTX, launch params). The torch path launches two
   kernels (the KV write, then attention); here the write is fused into the attention launch. Programs of one step
   run in any order, so nothing in this launch reads a slot it writes: a new key whose slot is >= 0 is read from
   the k/v inputs (the very values being written), and only keys cached before the step, or new keys with slot −1
   (not written), come from the pool. The KV-write-fused variant was measured and removed from the torch path (commit
   2680905: exact, 25-40% slower on H200); it is the only single-launch form, so TensorRT uses it.
2. **Argument order.** TensorRT passes input pointers (node order), then the extra SymInt32 scalars, then output
   pointers; kv_cache_out is aliased to kv_cache, so `CacheOut` is the same address as `Cache`.
3. **No float scalars.** The softmax scale is a constexpr (QK_SCALE = scale·log2 e), baked in at build time.
4. **No scratch.** Split-KV needs partial buffers TensorRT does not provide (no workspace in AOT plugins), so
   NUM_SEGMENTS is 1; there is no TMA on this path.
5. **Contiguous tensors.** TensorRT hands LINEAR (row-major, dense) buffers, so every stride follows from the
   shapes: the pool's are constexprs, q/k/v/out's head stride is T·D (T an extra arg).

The tile prologue (which sequence and rows a program owns, q's load), its key range and the key-tile loop over
cached keys are attention.py's own `_tile_prologue`, `_key_range` and `_attend_key_tiles`; only the write and the loop
over this step's new keys live here. ALiBi: the descs cannot tell
the zero initializer (no ALiBi) from real slopes, so the slopes are always applied; zeros add nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import triton
import triton.language as tl

from trtopt.plugins.paged_attention.attention import _attend_key_tiles, _key_range, _tile_prologue, fp8_dot_query
from trtopt.plugins.paged_attention.write_kv import fp8_saturate, value_offsets
from trtopt.plugins.trt_common import FLOAT_TYPES, FP8_TYPE, dot_precision
from trtopt.signature import KV_CACHE_DTYPES

_LOG2E = 1.4426950408889634


@triton.jit
def _write_tile_rows(
    k_new, v_new, cache_head, SlotMapping, first_row, num_tokens,
    stride_cb, stride_ckv, stride_co,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
    FP8_KV: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):
    """pool[slot // bs, :, head, slot % bs] = (k, v) for rows [first_row, first_row + ROWS) of one KV head; an FP8
    pool gets them quantized (write_kv.py `fp8_saturate`), its values transposed (`value_offsets`)."""
    rows = (first_row + tl.arange(0, ROWS)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(SlotMapping + rows, mask=rows < num_tokens, other=-1)
    mask = (slot >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    # k, v: [ROWS, BLOCK_D]; k/v rows are HEAD_DIM apart (contiguous [1, Hkv, T, D])
    k = tl.load(k_new + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    v = tl.load(v_new + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    if FP8_KV:
        k = fp8_saturate(k, K_SCALE)
        v = fp8_saturate(v, V_SCALE)
    block = cache_head + ((slot // BLOCK_SIZE) * stride_cb)[:, None]
    offset = (slot % BLOCK_SIZE)[:, None]
    tl.store(block + offset * stride_co + offs_d[None, :], k.to(cache_head.dtype.element_ty), mask=mask)
    tl.store(block + stride_ckv + value_offsets(offset, offs_d[None, :], stride_co, 1, FP8_KV, BLOCK_SIZE),
             v.to(cache_head.dtype.element_ty), mask=mask)


@triton.jit
def _attend_new_keys(
    acc, l_i, m_i, q,  # acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i: [BLOCK_M]; q: [BLOCK_M, BLOCK_D]
    k_new, v_new, k_head, table, SlotMapping, q_begin, context, start, end, pos, row_ok, slope,
    stride_cb, stride_ckv, stride_co,
    QK_SCALE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):
    """Fold keys at positions [start, end) (all >= context: this step's tokens) into the running softmax.

    A key whose slot is >= 0 is being written by some program of this launch, so it is read from the k/v inputs;
    one with slot −1 was not written and is read from the pool, as the op's semantics say. Over an FP8 pool both
    become e4m3 codes, the inputs quantized as `_write_tile_rows` stores them, so a new key counts with the value
    the pool holds for it; the scales go on the scores and probabilities, as in `_attend_key_tiles`.
    """
    offs_t = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if FP8_KV:
        qd = fp8_dot_query(q)
    else:
        qd = q
    for n0 in range(start, end, TILE_N):
        kpos = n0 + offs_t
        k_ok = kpos < end
        row = (q_begin + kpos - context).to(tl.int64)  # the key's row among the T new tokens
        slot = tl.load(SlotMapping + row, mask=k_ok, other=-1)
        from_input = (k_ok & (slot >= 0))[:, None] & d_ok[None, :]
        from_pool = (k_ok & (slot < 0))[:, None] & d_ok[None, :]
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok & (slot < 0), other=0).to(tl.int64)
        block_ptr = k_head + (block * stride_cb)[:, None]
        offset = (kpos % BLOCK_SIZE)[:, None]
        key_ptr = block_ptr + offset * stride_co + offs_d[None, :]
        value_ptr = block_ptr + stride_ckv + value_offsets(offset, offs_d[None, :], stride_co, 1, FP8_KV, BLOCK_SIZE)
        input_off = row[:, None] * HEAD_DIM + offs_d[None, :]
        # The masks are disjoint and masked lanes load 0, so the sum selects. k: [TILE_N, BLOCK_D]
        k_in = tl.load(k_new + input_off, mask=from_input, other=0.0)
        if FP8_KV:
            k_in = fp8_saturate(k_in, K_SCALE).to(k_head.dtype.element_ty)
            k = tl.load(key_ptr, mask=from_pool, other=0.0).to(qd.dtype) + k_in.to(qd.dtype)
            qk = tl.dot(qd, tl.trans(k), input_precision=DOT_PRECISION) * K_SCALE
        else:
            k = tl.load(key_ptr, mask=from_pool, other=0.0) + k_in
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N], unscaled
        qk = qk * QK_SCALE + slope[:, None] * (kpos[None, :] - pos[:, None]).to(tl.float32)
        visible = k_ok[None, :] & row_ok[:, None]
        if IS_CAUSAL:
            visible = visible & (kpos[None, :] <= pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (kpos[None, :] > pos[:, None] - SLIDING_WINDOW)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_in = tl.load(v_new + input_off, mask=from_input, other=0.0)
        if FP8_KV:
            v_in = fp8_saturate(v_in, V_SCALE).to(k_head.dtype.element_ty)
            v = tl.load(value_ptr, mask=from_pool, other=0.0).to(qd.dtype) + v_in.to(qd.dtype)
            acc = acc * alpha[:, None] + tl.dot((p * V_SCALE).to(qd.dtype), v, input_precision=DOT_PRECISION)
        else:
            v = tl.load(value_ptr, mask=from_pool, other=0.0) + v_in
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def paged_attention_aot_kernel(
    Q, K, V, Cache, BlockTables, SeqLens, QueryStartLoc, SlotMapping, Alibi,  # inputs, node order
    num_tokens, num_seqs, max_blocks,  # extra args (SymInt32): T, S, block_tables' row length
    Out, CacheOut,  # outputs; CacheOut aliases Cache
    QK_SCALE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    # Dense strides: pool [num_blocks, 2, Hkv, bs, D]; q/k/v/out [1, H, T, D].
    stride_co: tl.constexpr = HEAD_DIM
    stride_ch: tl.constexpr = BLOCK_SIZE * HEAD_DIM
    stride_ckv: tl.constexpr = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM
    stride_cb: tl.constexpr = 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM
    stride_h = num_tokens.to(tl.int64) * HEAD_DIM
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    k_new = K + kvh.to(tl.int64) * stride_h
    v_new = V + kvh.to(tl.int64) * stride_h

    # The KV write: program `tile` stores flat rows [tile·BLOCK_Q, +BLOCK_Q) of this KV head; the grid's
    # T // BLOCK_Q + S >= cdiv(T, BLOCK_Q) tiles (S >= 1) cover every row.
    _write_tile_rows(k_new, v_new, CacheOut + kvh.to(tl.int64) * stride_ch, SlotMapping, tile * BLOCK_Q, num_tokens,
                     stride_cb, stride_ckv, stride_co, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_Q, FP8_KV, K_SCALE, V_SCALE)

    seq, q_begin, q_first, n_new, seq_len, context, head, row_ok, row, pos, q, q_mask, offs_d = _tile_prologue(
        Q, SeqLens, QueryStartLoc, num_seqs, tile, kvh, stride_h, HEAD_DIM, 1,
        GROUP, GROUP_PAD, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D,
    )
    if q_first >= n_new:
        return
    q_off = head[:, None].to(tl.int64) * stride_h + row[:, None] * HEAD_DIM + offs_d[None, :]  # as q was loaded
    slope = tl.load(Alibi + head, mask=row_ok, other=0.0) * 1.4426950408889634  # log2 units, like the scores

    kv_lo, kv_hi, full_end = _key_range(context, q_first, n_new, seq_len, SLIDING_WINDOW,
                                        BLOCK_Q, TILE_N, IS_CAUSAL, SLIDING_WINDOW > 0)
    # Cached keys [kv_lo, old_end) come from the pool: whole tiles visible to every row unmasked, the rest masked
    # with key_end = old_end, so no pool position >= context (being written now) is ever read.
    old_end = tl.minimum(kv_hi, context)
    full_old = tl.maximum(tl.minimum(full_end, old_end // TILE_N * TILE_N), kv_lo)
    masked_end = tl.maximum(old_end, full_old)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: rows with no visible key stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * max_blocks
    k_head = Cache + kvh.to(tl.int64) * stride_ch
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_head, table, kv_lo, full_old, old_end, pos, row_ok, slope, QK_SCALE, SLIDING_WINDOW,
        stride_cb, stride_ckv, stride_co, 1,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, False, IS_CAUSAL, True, SLIDING_WINDOW > 0, DOT_PRECISION,
        FP8_KV, K_SCALE, V_SCALE,
    )
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_head, table, full_old, masked_end, old_end, pos, row_ok, slope, QK_SCALE,
        SLIDING_WINDOW, stride_cb, stride_ckv, stride_co, 1,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, True, IS_CAUSAL, True, SLIDING_WINDOW > 0, DOT_PRECISION,
        FP8_KV, K_SCALE, V_SCALE,
    )
    acc, l_i, m_i = _attend_new_keys(
        acc, l_i, m_i, q, k_new, v_new, k_head, table, SlotMapping, q_begin, context, tl.maximum(kv_lo, context),
        kv_hi, pos, row_ok, slope, stride_cb, stride_ckv, stride_co,
        QK_SCALE, SLIDING_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, IS_CAUSAL, DOT_PRECISION,
        FP8_KV, K_SCALE, V_SCALE,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + q_off, out.to(Out.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------------------------------
# Build-time planning: plain functions of the attributes and shapes, shared by aot_impl and the tests.
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AotTiling:
    """The one tiling baked into the engine (no per-step planning without Python at run time)."""

    block_q: int  # query tokens per tile
    tile_n: int  # key positions per loop iteration
    num_warps: int
    num_stages: int


def aot_tiling(num_heads: int, num_kv_heads: int, *, interpret: bool = False) -> AotTiling:
    """Decode-shaped tiles (16 rows of BLOCK_Q tokens × the GQA group): decode dominates a serving engine, and
    prefill stays correct with them, only slower. tile_n 64 is the middle of planning.plan_paged_launch's choices."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_q = max(1, 16 // group_pad)
    if interpret:
        return AotTiling(block_q=block_q, tile_n=16, num_warps=4, num_stages=1)
    return AotTiling(block_q=block_q, tile_n=64, num_warps=4, num_stages=3)


def aot_signature(float_type: str, *, fp8_pool: bool = False) -> dict[str, str]:
    """Triton types of the entry kernel's runtime parameters, in TensorRT's order; float_type is q's ("fp16"), and
    the pool is float_type too, or e4m3 (FP8_TYPE) for a node with kv_cache_dtype="fp8"."""
    assert float_type in FLOAT_TYPES, f"PagedAttention runs in {FLOAT_TYPES}; got {float_type}"
    f = f"*{float_type}"
    pool = f"*{FP8_TYPE}" if fp8_pool else f
    return {
        "Q": f, "K": f, "V": f, "Cache": pool, "BlockTables": "*i32", "SeqLens": "*i32", "QueryStartLoc": "*i32",
        "SlotMapping": "*i64", "Alibi": "*fp32",
        "num_tokens": "i32", "num_seqs": "i32", "max_blocks": "i32",
        "Out": f, "CacheOut": pool,
    }


def aot_constexprs(*, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int,
                   sliding_window: int, block_size: int, float_type: str, tiling: AotTiling,
                   kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> dict[str, Any]:
    """The entry kernel's constexprs from the node's attributes and the pool's (build-time constant) block size.
    kv_cache_dtype="fp8" (an FP8 pool) bakes in the layer's k_scale and v_scale, as scale is."""
    assert num_kv_heads > 0 and num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} kv heads"
    assert block_size > 0 and block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    assert math.isfinite(scale), f"scale {scale}"
    assert kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype {kv_cache_dtype!r}"
    fp8 = kv_cache_dtype == "fp8"
    assert not fp8 or all(math.isfinite(s) and s > 0 for s in (k_scale, v_scale)), f"scales {k_scale}, {v_scale}"
    group = num_heads // num_kv_heads
    return {
        "QK_SCALE": float(scale) * _LOG2E, "SLIDING_WINDOW": int(sliding_window), "NUM_KV_HEADS": num_kv_heads,
        "GROUP": group, "GROUP_PAD": triton.next_power_of_2(group), "BLOCK_Q": tiling.block_q, "HEAD_DIM": head_dim,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "BLOCK_SIZE": block_size, "TILE_N": tiling.tile_n,
        "IS_CAUSAL": bool(causal), "DOT_PRECISION": dot_precision(float_type),
        "FP8_KV": fp8, "K_SCALE": float(k_scale) if fp8 else 1.0, "V_SCALE": float(v_scale) if fp8 else 1.0,
    }


Dim = TypeVar("Dim")  # an int here, a tensorrt.plugin ShapeExpr in aot_impl: only + and // are used


def aot_grid(num_tokens: Dim, num_seqs: Dim, *, num_kv_heads: int, tiling: AotTiling) -> tuple[Dim, int, int]:
    """(T // BLOCK_Q + S, Hkv, 1): sequence s owns query tiles from qsl[s] // BLOCK_Q + s on (kernel.py's scheme)."""
    return num_tokens // tiling.block_q + num_seqs, num_kv_heads, 1


def aot_extra_args(num_tokens: Dim, num_seqs: Dim, max_blocks: Dim) -> tuple[Dim, Dim, Dim]:
    """The scalars between the input and output pointers, in the kernel's order."""
    return num_tokens, num_seqs, max_blocks


def launch_like_tensorrt(inputs: list[Any], outputs: list[Any], *, attrs: dict[str, Any], block_size: int,
                         float_type: str, tiling: AotTiling, grid_fn: Callable[..., tuple] = aot_grid) -> None:
    """Launch the entry kernel the way TensorRT will: inputs, extra args, outputs, constexprs; torch tensors.

    For tests (the Triton interpreter here, a GPU elsewhere); TensorRT itself launches the PTX.
    """
    q, block_tables, seq_lens = inputs[0], inputs[4], inputs[5]
    T, S, max_blocks = q.shape[2], seq_lens.shape[0], block_tables.shape[1]
    grid = grid_fn(T, S, num_kv_heads=attrs["num_kv_heads"], tiling=tiling)
    paged_attention_aot_kernel[grid](
        *inputs, *aot_extra_args(T, S, max_blocks), *outputs,
        **aot_constexprs(**attrs, block_size=block_size, float_type=float_type, tiling=tiling),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )


__all__ = ["AotTiling", "aot_tiling", "aot_signature", "aot_constexprs", "aot_grid", "aot_extra_args",
           "paged_attention_aot_kernel", "launch_like_tensorrt"]
