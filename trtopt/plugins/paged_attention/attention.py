"""PagedAttention over the paged KV pool as Triton kernels (face 4 of docs/architecture.md §4): the attention
kernel, the split-KV merge, and `paged_attention_triton`, the op's launcher.

One launch of the attention kernel serves a whole mixed step: prefill chunks, decode rows and speculative rows of
many sequences, packed in T rows with no padding. The grid cannot depend on per-sequence lengths (they live on the
device), so it is sized from shapes alone:

- axis 0 walks query tiles of BLOCK_Q tokens. Sequence s owns tiles starting at `qsl[s] // BLOCK_Q + s`; that bound
  is strictly increasing in s, so T // BLOCK_Q + S tiles cover every sequence, and a program finds its sequence by
  a binary search over query_start_loc (the same scheme as vLLM's unified Triton attention). Tiles past the end of
  their sequence exit at once.
- axis 1 is the KV head. A tile holds BLOCK_Q tokens × the GROUP query heads that share that KV head, so each KV
  block is read once per group (GQA/MQA) and the score matmul has BLOCK_Q·GROUP rows.
- axis 2 splits the key range into NUM_SEGMENTS (flash-decoding) when tiles × heads would leave the GPU idle: long
  contexts at small batch. The last segment of a tile to finish merges the segments' partial softmaxes (a counter
  per tile, planning.py `PagedLaunchState.merge_counters`); a second small kernel does it where no counters can be
  had, and past FUSED_MERGE_MAX_SEGMENTS segments, where it is faster.

The KV write (write_kv.py) is launched first. Rows are expected to belong to sequences (query_start_loc[S] == T);
rows past it are not written.

Keys are walked in tiles of TILE_N positions; each key finds its physical block through block_tables, so the tile
size is independent of the pool's block size. Pool layout: [num_blocks, 2, Hkv, block_size, D] (K at [:, 0], V at
[:, 1]); block 0 is the null block and slot −1 means "do not write".

An FP8 pool (float8_e4m3fn, kv_cache_dtype="fp8") is read with FP8_KV: each key and value tile is converted to fp16
in registers (fp32 for fp32 models; exact: every e4m3 value is one), q and the probabilities are held in fp16 for
the dots, and the dots accumulate in fp32 as for every pool. Its values are stored [D, block_size] per block, and
read so (`_fp8_value_tile`).
The scales (constexprs, write_kv.py says why) multiply the [BLOCK_M, TILE_N] scores and probabilities, not the
[TILE_N, D] tiles: a per-element multiply of every key and value cost FP8 pools a quarter of their decode speed-up
(docs/benchmarks/attention_h100.json, before and after). Its writes quantize (write_kv.py), the RoPE-fused one
included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.kernel_common import next_pow2
from trtopt.plugins.launcher import DriverLaunch, Launcher, current_stream
from trtopt.plugins.paged_attention import decode_cuda
from trtopt.plugins.paged_attention.planning import (
    PagedLaunch, PagedLaunchState, WorkspaceBudget, _device_sm_count, _MetadataMemo, plan_paged_launch,
)
from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE
from trtopt.plugins.paged_attention.write_kv import (
    _rope_write_kv_kernel, _rope_write_kv_launch, _write_kv_launch, fp8_constexprs, pool_scales, rope_write_kv_triton,
    write_kv_triton,
)

_LOG2E = 1.4426950408889634
# Split-KV launches of more segments merge in a second launch (`_merge_segments_kernel`, a program per row and
# head), not in the attention launch: there one program merges a tile's segments at the end, which at 32 and 64
# segments lengthened the launch's tail past a second launch's cost. H200, bf16 B1·L32K decode, graph replays:
# 64 segments 69.3 µs fused against 54.1 µs in two launches, 32 segments 56.3 against 53.8, 16 segments 57.0
# against 57.3 (FP8 pools, 32 segments: 50.7 against 43.0). Session 29; docs/benchmarks/NOTES.md.
FUSED_MERGE_MAX_SEGMENTS = 16
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _find_sequence(QueryStartLoc, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest s with qsl[s] // BLOCK_Q + s <= tile (binary search; the key is strictly increasing in s)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(QueryStartLoc + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_prologue(
    Q, SeqLens, QueryStartLoc, num_seqs, tile, kvh, stride_qh, stride_qt, stride_qd,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """What program (tile, kvh) works on, shared by the launched kernel and the TensorRT AOT one (trt_aot.py).

    Returns (seq, q_begin, q_first, n_new, seq_len, context, head, row_ok, row, pos, q, q_mask, offs_d). Row m of
    the tile is token q_first + m // GROUP_PAD of sequence ``seq``, query head kvh·GROUP + m % GROUP_PAD; q is
    [BLOCK_M, BLOCK_D]. A tile past its sequence's tokens has q_first >= n_new: the caller returns then (its rows
    are all masked, so nothing here reads out of bounds).
    """
    seq = _find_sequence(QueryStartLoc, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(QueryStartLoc + seq)
    n_new = tl.load(QueryStartLoc + seq + 1) - q_begin
    q_first = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first token of this tile, local to the sequence
    seq_len = tl.load(SeqLens + seq)
    context = seq_len - n_new  # tokens cached before this step
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_first + offs_m // GROUP_PAD
    head = kvh * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < n_new) & (offs_m % GROUP_PAD < GROUP)
    row = (q_begin + tok).to(tl.int64)
    pos = context + tok  # absolute position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + head[:, None].to(tl.int64) * stride_qh + row[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    return seq, q_begin, q_first, n_new, seq_len, context, head, row_ok, row, pos, q, q_mask, offs_d


@triton.jit
def _key_range(context, q_first, n_new, seq_len, sliding_window,
               BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(kv_lo, kv_hi, full_end) of a tile: it needs keys [kv_lo, kv_hi) (causal rows stop at their own position, a
    window starts later), and keys below full_end are visible to every row of it (causal or not, no window)."""
    last_tok = tl.minimum(q_first + BLOCK_Q, n_new) - 1
    if IS_CAUSAL:
        kv_hi = context + last_tok + 1
    else:
        kv_hi = seq_len
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(context + q_first - sliding_window + 1, 0) // TILE_N * TILE_N
    if IS_CAUSAL and not HAS_WINDOW:
        full_end = (context + q_first + 1) // TILE_N * TILE_N
    elif not IS_CAUSAL and not HAS_WINDOW:
        full_end = seq_len // TILE_N * TILE_N
    else:
        full_end = 0
    return kv_lo, kv_hi, full_end


@triton.jit
def fp8_dot_query(q):
    """q as the dots over an FP8 pool's tiles take it. FP8 tiles widen to fp16 in one instruction per pair (bf16
    takes a longer sequence, which made the read compute-bound), so a 16-bit q is held in fp16 for the dots, clamped
    to fp16's range (more mantissa than bf16 inside it); an fp32 q stays fp32. TensorRT's AOT kernel shares it."""
    qd = q
    if q.dtype != tl.float32:
        qd = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return qd


@triton.jit
def _fp8_value_tile(v_head, table, n0, key_end, stride_cb, offs_d, d_ok,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    MASKED: tl.constexpr):
    """Values of keys [n0, n0 + TILE_N) of an FP8 pool as a [TILE_N, BLOCK_D] tile (zero past key_end).

    An FP8 pool stores each block's values as [D, block_size] (reference.pool_values), so the tile is RUNS runs
    of RUN keys, each run a [BLOCK_D, RUN] slab of one block with its keys contiguous: loaded as such and permuted
    to key-major in registers. Stored [block_size, D], the P·V dot needed each tile transposed on the way in, which
    Triton gathers from shared memory one byte per load for 8-bit data; read this way the B64·L4096 decode timed
    1.69× bf16 against 1.29× (H200, docs/benchmarks/probe_fp8_value_layout_h200.json)."""
    RUN: tl.constexpr = TILE_N if TILE_N < BLOCK_SIZE else BLOCK_SIZE
    RUNS: tl.constexpr = TILE_N // RUN
    first = n0 + tl.arange(0, RUNS) * RUN  # each run's first key
    offs_o = tl.arange(0, RUN)
    if MASKED:
        blocks = tl.load(table + first // BLOCK_SIZE, mask=first < key_end, other=0).to(tl.int64)
    else:
        blocks = tl.load(table + first // BLOCK_SIZE).to(tl.int64)
    if TILE_N >= BLOCK_SIZE:
        runs = blocks * stride_cb  # whole blocks: every run starts a block (and the compiler sees the alignment)
    else:
        runs = blocks * stride_cb + tl.multiple_of(n0 % BLOCK_SIZE, RUN)  # the tile is one run inside a block
    ptr = v_head + runs[:, None, None] + (offs_d * BLOCK_SIZE)[None, :, None] + offs_o[None, None, :]
    if MASKED:  # 0 past key_end: a slot not yet written may hold any byte, NaN included, and 0 · NaN is NaN
        visible = (first[:, None] + offs_o[None, :]) < key_end  # [RUNS, RUN]
        v = tl.load(ptr, mask=visible[:, None, :] & d_ok[None, :, None], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        v = tl.load(ptr, mask=d_ok[None, :, None], other=0.0)
    else:
        v = tl.load(ptr)
    return tl.reshape(tl.permute(v, (0, 2, 1)), (TILE_N, BLOCK_D))


@triton.jit
def _attend_key_tiles(
    acc, l_i, m_i, q,  # acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i: [BLOCK_M]; q: [BLOCK_M, BLOCK_D]
    k_head, table, start, end, key_end, pos, row_ok, slope, qk_scale, sliding_window,
    stride_cb, stride_ckv, stride_co, stride_cd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr, k_scale, v_scale,
):
    """Fold key tiles [start, end) (TILE_N-aligned) into the running softmax; keys >= key_end are never read.
    k_scale, v_scale: an FP8 pool's (runtime values here, TensorRT's AOT kernel's constexprs)."""
    offs_t = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if FP8_KV:
        qd = fp8_dot_query(q)
    else:
        qd = q
    # Tiles start at multiples of TILE_N and both sizes are powers of two, so a key's offset inside its block is
    # (n0 % BLOCK_SIZE) + (t % BLOCK_SIZE): the per-element part of the address is loop-invariant.
    in_tile = (offs_t % BLOCK_SIZE)[:, None] * stride_co + offs_d[None, :] * stride_cd  # [TILE_N, BLOCK_D]
    for n0 in range(start, end, TILE_N):
        kpos = n0 + offs_t
        k_ok = kpos < key_end
        if MASKED:
            block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            block = tl.load(table + kpos // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        kv_ptr = k_head + (block * stride_cb + (n0 % BLOCK_SIZE) * stride_co)[:, None] + in_tile
        if MASKED or BLOCK_D != HEAD_DIM:
            k = tl.load(kv_ptr, mask=kv_mask, other=0.0)  # k: [TILE_N, BLOCK_D]
        else:
            k = tl.load(kv_ptr)  # unmasked and unpadded: the loads vectorise freely
        if FP8_KV:  # e4m3 is exact in fp16/fp32; the scale goes on the [BLOCK_M, TILE_N] scores, not on each key
            qk = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=DOT_PRECISION) * k_scale
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # qk: [BLOCK_M, TILE_N], unscaled
        if HAS_ALIBI:
            qk = qk * qk_scale + slope[:, None] * (kpos[None, :] - pos[:, None]).to(tl.float32)
        if MASKED:
            visible = k_ok[None, :] & row_ok[:, None]
            if IS_CAUSAL:
                visible = visible & (kpos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] > pos[:, None] - sliding_window)
            qk = tl.where(visible, qk, float("-inf"))
        # Scores are in log2 units (exp2); without ALiBi the scale folds into the subtraction as one FMA.
        if HAS_ALIBI:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_KV:
            v = _fp8_value_tile(k_head + stride_ckv, table, n0, key_end, stride_cb, offs_d, d_ok,
                                HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, MASKED)
        elif MASKED or BLOCK_D != HEAD_DIM:
            v = tl.load(kv_ptr + stride_ckv, mask=kv_mask, other=0.0)  # v: [TILE_N, BLOCK_D]
        else:
            v = tl.load(kv_ptr + stride_ckv)
        if FP8_KV:  # as for k: the scale goes on the probabilities (l_i above summed them unscaled)
            acc = acc * alpha[:, None] + tl.dot((p * v_scale).to(qd.dtype), v.to(qd.dtype),
                                                input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_attn_kernel(
    Q, Cache, BlockTables, SeqLens, QueryStartLoc, Alibi,
    Out, PartAcc, PartMax, PartSum, Counters,
    qk_scale,  # softmax scale · log2(e)
    k_scale, v_scale,  # an FP8 pool's scales (write_kv.py pool_scales; 1.0 and unread for other pools)
    num_seqs, sliding_window,
    stride_qh, stride_qt, stride_qd,
    stride_cb, stride_ckv, stride_ch, stride_co, stride_cd,
    stride_bt,
    stride_oh, stride_ot, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MERGE: tl.constexpr,
    FP8_KV: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    segment = tl.program_id(2)

    seq, q_begin, q_first, n_new, seq_len, context, head, row_ok, row, pos, q, q_mask, offs_d = _tile_prologue(
        Q, SeqLens, QueryStartLoc, num_seqs, tile, kvh, stride_qh, stride_qt, stride_qd,
        GROUP, GROUP_PAD, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D,
    )
    if q_first >= n_new:
        return
    if HAS_ALIBI:
        slope = tl.load(Alibi + head, mask=row_ok, other=0.0) * 1.4426950408889634
    else:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)

    kv_lo, kv_hi, full_end = _key_range(context, q_first, n_new, seq_len, sliding_window,
                                        BLOCK_Q, TILE_N, IS_CAUSAL, HAS_WINDOW)
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    seg_lo = kv_lo + segment * tiles_per_segment * TILE_N
    seg_hi = tl.minimum(seg_lo + tiles_per_segment * TILE_N, kv_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: rows with no visible key stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    k_head = Cache + kvh.to(tl.int64) * stride_ch
    # Tiles below `full_end` skip the mask arithmetic; the rest (the diagonal, the window edge, the end) are masked.
    split = tl.maximum(tl.minimum(full_end, seg_hi), seg_lo)
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_head, table, seg_lo, split, seg_hi, pos, row_ok, slope, qk_scale, sliding_window,
        stride_cb, stride_ckv, stride_co, stride_cd,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, False, IS_CAUSAL, HAS_ALIBI, HAS_WINDOW, DOT_PRECISION,
        FP8_KV, k_scale, v_scale,
    )
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_head, table, split, seg_hi, seg_hi, pos, row_ok, slope, qk_scale, sliding_window,
        stride_cb, stride_ckv, stride_co, stride_cd,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, True, IS_CAUSAL, HAS_ALIBI, HAS_WINDOW, DOT_PRECISION,
        FP8_KV, k_scale, v_scale,
    )

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + head[:, None].to(tl.int64) * stride_oh + row[:, None] * stride_ot + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [T, Hq, NUM_SEGMENTS, (BLOCK_D)] fp32, contiguous; every segment writes, even an empty one.
        base = (row * tl.num_programs(1) * GROUP + head) * NUM_SEGMENTS
        part = base + segment
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)
        tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        if MERGE:
            # The tile's last segment to finish merges them all (no second launch). Every thread's partials are
            # stored before the barrier; the counter's acq_rel add publishes them (release is cumulative) and
            # acquires the other segments'. The merging program puts the counter back to 0 for the next launch.
            tl.debug_barrier()
            counter = Counters + tile * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SEGMENTS - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed")
                out = _merge_rows(PartAcc, PartMax, PartSum, base, row_ok, offs_d, NUM_SEGMENTS, BLOCK_M, BLOCK_D)
                tl.store(Out + head[:, None].to(tl.int64) * stride_oh + row[:, None] * stride_ot
                         + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_segment(PartAcc, PartMax, PartSum, part, row_ok, offs_d, m_run, total, acc, BLOCK_D: tl.constexpr):
    """Fold one segment's partials (read past L1, .cg: another program wrote them) into the running merge."""
    m = tl.load(PartMax + part, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
    l = tl.load(PartSum + part, mask=row_ok, other=0.0, cache_modifier=".cg")
    a = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                cache_modifier=".cg")
    m_new = tl.maximum(m_run, m)
    alpha = tl.math.exp2(m_run - m_new)
    beta = tl.math.exp2(m - m_new)
    return m_new, total * alpha + l * beta, acc * alpha[:, None] + a * beta[:, None]


@triton.jit
def _merge_rows(PartAcc, PartMax, PartSum, base, row_ok, offs_d,
                NUM_SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows' merged output Σ_seg exp2(m_seg − M)·acc_seg / Σ_seg exp2(m_seg − M)·l_seg from their partials at
    base + seg, in one pass (a running max). Up to 16 segments the loop is unrolled, so that every segment's loads
    are in flight at once: this is the launch's tail, and a loop of dependent L2 round trips would lengthen it."""
    m_run = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if NUM_SEGMENTS <= 16:
        for s in tl.static_range(NUM_SEGMENTS):
            m_run, total, acc = _merge_segment(PartAcc, PartMax, PartSum, base + s, row_ok, offs_d, m_run, total,
                                               acc, BLOCK_D)
    else:
        for s in range(NUM_SEGMENTS):
            m_run, total, acc = _merge_segment(PartAcc, PartMax, PartSum, base + s, row_ok, offs_d, m_run, total,
                                               acc, BLOCK_D)
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_segments_kernel(
    PartAcc, PartMax, PartSum, Out,
    num_heads, stride_oh, stride_ot, stride_od,
    NUM_SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t, h] = Σ_seg exp2(m_seg − M)·acc_seg / Σ_seg exp2(m_seg − M)·l_seg (one program per row and head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(PartMax + base + offs_s)
    l = tl.load(PartSum + base + offs_s)
    acc = tl.load(PartAcc + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :])  # [NUM_SEGMENTS, BLOCK_D]
    w = tl.math.exp2(m - tl.max(m, 0))
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + h.to(tl.int64) * stride_oh + t * stride_ot + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)



# ---------------------------------------------------------------------------------------------------------------------
# The launcher.
# ---------------------------------------------------------------------------------------------------------------------
def _check_paged_inputs(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                        num_heads, num_kv_heads, head_dim, alibi_slopes, memo: _MetadataMemo) -> None:
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != num_heads or q.shape[3] != head_dim:
        raise ValueError(f"q must be [1, num_heads={num_heads}, T, head_dim={head_dim}]; got {tuple(q.shape)}")
    T = q.shape[2]
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (1, num_kv_heads, T, head_dim):
            raise ValueError(f"{name} must be [1, {num_kv_heads}, {T}, {head_dim}]; got {tuple(x.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[2] != num_kv_heads \
            or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [num_blocks, 2, {num_kv_heads}, block_size, {head_dim}]; "
                         f"got {tuple(kv_cache.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES or any(x.dtype != q.dtype for x in (k, v)) \
            or kv_cache.dtype not in (q.dtype, FP8_POOL_DTYPE):
        raise ValueError(f"q/k/v/kv_cache must share one dtype of {_SUPPORTED_DTYPES} (or kv_cache be float8_e4m3fn); "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}, {kv_cache.dtype}")
    if alibi_slopes is not None and (alibi_slopes.shape != (num_heads,) or alibi_slopes.dtype != torch.float32
                                     or not alibi_slopes.is_contiguous() or alibi_slopes.device != q.device):
        raise ValueError(f"alibi_slopes must be contiguous float32 [{num_heads}] on {q.device}; got "
                         f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}")
    if not (q.device == k.device == v.device == kv_cache.device):
        raise ValueError(f"q/k/v/kv_cache must be on one device; got {q.device}, {k.device}, {v.device}, "
                         f"{kv_cache.device}")
    metadata = (block_tables, seq_lens, query_start_loc, slot_mapping)
    memo.key(*metadata)  # re-reads (and forgets the check) when these are not the tensors last seen
    if memo.checked == (T, q.device):
        return  # the same step's metadata, checked for an earlier layer (plan once per step, STYLE.md §10)
    _check_step_metadata(T, q.device, *metadata)
    memo.checked = (T, q.device)


def _check_step_metadata(T, device, block_tables, seq_lens, query_start_loc, slot_mapping) -> None:
    S = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    expected = ((block_tables, torch.int32, 2), (seq_lens, torch.int32, 1), (query_start_loc, torch.int32, 1),
                (slot_mapping, torch.int64, 1))
    for (x, dtype, dims), name in zip(expected, ("block_tables", "seq_lens", "query_start_loc", "slot_mapping")):
        if x.dtype != dtype or x.dim() != dims or x.stride(-1) != 1:
            raise ValueError(f"{name} must be a {dims}-D {dtype} tensor with unit last stride; "
                             f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if block_tables.shape[0] != S or query_start_loc.shape[0] != S + 1 or slot_mapping.shape[0] != T:
        raise ValueError(f"metadata shapes disagree: block_tables {tuple(block_tables.shape)}, seq_lens [{S}], "
                         f"query_start_loc {tuple(query_start_loc.shape)} (want [S+1]), slot_mapping "
                         f"{tuple(slot_mapping.shape)} (want [T={T}])")
    if any(x.device != device for x in (block_tables, seq_lens, query_start_loc, slot_mapping)):
        raise ValueError(f"all inputs must be on one device ({device}); got block_tables {block_tables.device}, "
                         f"seq_lens {seq_lens.device}, query_start_loc {query_start_loc.device}, slot_mapping "
                         f"{slot_mapping.device}")


def _output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {like.dtype} {shape} on {like.device}; got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")
    return out


def paged_attention_triton(
    q: torch.Tensor,  # [1, Hq, T, D], any strides (e.g. a transposed view)
    k: torch.Tensor,  # [1, Hkv, T, D]
    v: torch.Tensor,  # [1, Hkv, T, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, Hkv, block_size, D], written in place
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    seq_lens: torch.Tensor,  # int32 [S], cached tokens after this step
    query_start_loc: torch.Tensor,  # int32 [S+1]
    slot_mapping: torch.Tensor,  # int64 [T], −1 = do not write
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: int = 1,
    sliding_window: int = 0,
    alibi_slopes: torch.Tensor | None = None,  # float32 [Hq]
    launch: PagedLaunch | decode_cuda.CudaDecodePlan | None = None,
    out: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,  # [.., T, D] broadcastable to [1, 1, T, D], q's dtype
    rope_sin: torch.Tensor | None = None,
    kv_written: bool = False,
    state: PagedLaunchState | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new K/V at slot_mapping, then attend each new token over its sequence's cache.

    Returns (out [1, Hq, T, D] in q's dtype, kv_cache) — the same kv_cache object, written in place. `launch`
    overrides the shape-derived tiling (benchmarks and tests use it to force split-KV or tile sizes; a
    decode_cuda.CudaDecodePlan forces the CUDA decode kernel, and its segments); `out`, if
    given, is a preallocated [1, Hq, T, D] buffer to write (CUDA graphs need fixed addresses). With rope_cos and
    rope_sin, q and k are the tensors *before* RoPE: one kernel rotates both and writes the pool
    (rope_write_kv_triton), bit for bit what trtopt::Rope on each and then this op give, with two launches fewer;
    the torch executor's `fuse_rope_into_paged_attention` (fx_fusions.py) routes the plan's Rope nodes here.
    With kv_written, this step's k and v are already in the pool and q is final (the torch executor's Q/K/V GEMV
    with RoPE and the KV write as its epilogue, runtime/kernels/gemv_triton.py `gemv_rope_kv`): only the attention
    kernels run. q, k and v must then be head-major views of that projection's one output row, which is checked.

    Planned once per step shape, launched per layer (STYLE.md §10): the first call of a shape checks everything,
    plans the tiling and prepares its launches (`_PagedPlan`); every later call whose inputs have the same shapes,
    strides, dtypes and devices (every other layer of the step, and the steps after it) only allocates its outputs
    and launches the prepared kernels with its own tensors. The plans, the merge counters and the launcher's switch
    are `state`'s (planning.py `PagedLaunchState`, the torch executor's); a call without one makes a state of its
    own that ends with it, and plans nothing.

    An FP8 pool (float8_e4m3fn) stores k / k_scale and v / v_scale and is read × scale (reference.to_pool /
    from_pool), through the same planned launches; every write quantizes (the RoPE-fused one, and gemv_rope_kv's
    before a kv_written call). On a GPU its decode steps are attended by the CUDA kernel of decode_cuda.py where
    that serves them (`decode_cuda.why_not`; `state.cuda_decode = False` keeps the Triton kernel), planned and
    launched the same way.
    """
    key = None
    owned = state is not None
    if not owned:
        state = PagedLaunchState()
    if owned and launch is None and out is None and not state.launcher.dispatcher_only:
        key = state.plan_key(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, num_heads,
                             num_kv_heads, head_dim, scale, causal, sliding_window, alibi_slopes, rope_cos, rope_sin,
                             kv_written)
        plan = state.plans.get(key)
        if plan is not None:
            result = plan(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes,
                          rope_cos, rope_sin, k_scale, v_scale)
            if result is not None:
                return result, kv_cache

    _check_paged_inputs(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                        num_heads, num_kv_heads, head_dim, alibi_slopes, state.metadata)
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 = none); got {sliding_window}")
    T, S = q.shape[2], seq_lens.shape[0]
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError("rope_cos and rope_sin come together (both or neither)")
    q_in = q
    if kv_written:
        _check_written_layout(q, k, v, rope_cos, num_heads, num_kv_heads, head_dim)
    elif rope_cos is not None:
        q = rope_write_kv_triton(q, k, v, rope_cos, rope_sin, kv_cache, slot_mapping, launcher=state.launcher,
                                 k_scale=k_scale, v_scale=v_scale)
    else:
        write_kv_triton(k, v, kv_cache, slot_mapping, launcher=state.launcher, k_scale=k_scale, v_scale=v_scale)
    out = _output_buffer(out, (1, num_heads, T, head_dim), q)
    if T == 0 or S == 0:
        return out, kv_cache

    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[3]
    interpret = q.device.type != "cuda"
    max_context = block_tables.shape[1] * block_size
    # An FP8 pool's decode on a GPU takes the CUDA kernel (decode_cuda.py) where it serves the step; a
    # CudaDecodePlan given as `launch` asks for it (benchmarks and tests), and it must then serve the step.
    cuda = launch if isinstance(launch, decode_cuda.CudaDecodePlan) else None
    if cuda is not None or (launch is None and state.cuda_decode and kv_cache.dtype == FP8_POOL_DTYPE
                            and not interpret):
        cuda = decode_cuda.choose(q, kv_cache, num_tokens=T, num_seqs=S, group=group, head_dim=head_dim,
                                  alibi_slopes=alibi_slopes, launcher=state.launcher, max_context=max_context,
                                  sm_count=_device_sm_count(q.device), forced=cuda)
        if cuda is not None:
            launch = PagedLaunch(block_q=1, tile_n=block_size, num_segments=cuda.num_segments, num_warps=4,
                                 num_stages=1)  # what the scratch and the merge are sized from
    if launch is None:
        launch = plan_paged_launch(T, S, num_kv_heads, group, max_context, _device_sm_count(q.device),
                                   interpret=interpret, kv_bytes=kv_cache.element_size())
    block_d = max(16, next_pow2(head_dim))
    scratch = _Scratch(T * num_heads * launch.num_segments, block_d) if launch.num_segments > 1 else None
    part_acc, part_max, part_sum = scratch.views(q.device) if scratch else (out, out, out)
    counters = (state.merge_counters(q.device, (T // launch.block_q + S) * num_kv_heads)
                if scratch and cuda is None and launch.num_segments <= FUSED_MERGE_MAX_SEGMENTS else None)
    if cuda is not None:
        attention = decode_cuda.cuda_decode_launch(
            q, kv_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_max, part_sum,
            score_scale=scale * _LOG2E, causal=causal, sliding_window=sliding_window, plan=cuda, group=group,
            head_dim=head_dim, part_stride=block_d, scales=pool_scales(kv_cache, k_scale, v_scale))
        attention[0].launch(*attention[1:])
    else:
        attention = _attention_launch(q, kv_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, out,
                                      part_acc, part_max, part_sum, counters, scale, S, sliding_window, launch,
                                      block_d, group=group, head_dim=head_dim, causal=causal,
                                      scales=pool_scales(kv_cache, k_scale, v_scale))
        state.launcher.launch(attention[0], attention[1], *attention[2], **attention[3])
    merge = None
    if scratch and cuda is not None:
        merge = decode_cuda.cuda_merge_launch(part_acc, part_max, part_sum, out, plan=cuda, group=group,
                                              head_dim=head_dim, part_stride=block_d)
        merge[0].launch(*merge[1:])
    elif scratch and counters is None:
        merge = _merge_launch(part_acc, part_max, part_sum, out, launch, head_dim, block_d)
        state.launcher.launch(merge[0], merge[1], *merge[2], **merge[3])
    if key is not None:
        if kv_written:
            kv_write = None
        elif rope_cos is not None:
            kv_write = _rope_write_kv_launch(q_in, k, v, rope_cos, rope_sin, q, kv_cache, slot_mapping, k_scale,
                                             v_scale)
        else:
            kv_write = _write_kv_launch(k, v, kv_cache, slot_mapping, k_scale, v_scale)
        state.remember(key, _PagedPlan(kv_write, attention, merge, scratch, counters, device=q.device,
                                       launcher=state.launcher, budget=state.budget))
    return out, kv_cache


def _check_written_layout(q, k, v, rope_cos, num_heads, num_kv_heads, head_dim) -> None:
    """kv_written's precondition: q, k and v are the head-major [Hq·D | Hkv·D | Hkv·D] parts of one projection
    output (the layout gemv_rope_kv wrote the pool from), and no RoPE is left to apply."""
    if rope_cos is not None:
        raise ValueError("kv_written=True takes q and k already rotated: pass no rope_cos/rope_sin")
    size = q.element_size()
    head_major = all(x.stride(1) == head_dim and x.stride(3) == 1 for x in (q, k, v))
    if not (q.shape[2] == 1 and head_major and k.data_ptr() - q.data_ptr() == num_heads * head_dim * size
            and v.data_ptr() - k.data_ptr() == num_kv_heads * head_dim * size):
        raise ValueError("kv_written=True needs q, k and v of one token as head-major views of one fused Q/K/V row "
                         f"(what gemv_rope_kv wrote the pool from); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)} with strides {q.stride()}, {k.stride()}, {v.stride()}")


def _attention_launch(q, kv_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, out, part_acc, part_max,
                      part_sum, counters, scale, S, sliding_window, launch, block_d, *, group, head_dim, causal,
                      scales: tuple[float, float] = (1.0, 1.0)):
    """(kernel, grid, args, constexprs) of the attention kernel; with counters (split-KV only) it merges the
    segments itself, else a split launch needs `_merge_launch` after it."""
    T = q.shape[2]
    return _paged_attn_kernel, (T // launch.block_q + S, kv_cache.shape[2], launch.num_segments), (
        q, kv_cache, block_tables, seq_lens, query_start_loc,
        alibi_slopes if alibi_slopes is not None else q,
        out, part_acc, part_max, part_sum, counters if counters is not None else q,
        scale * _LOG2E, *scales, S, sliding_window,
        *q.stride()[1:], *kv_cache.stride(), block_tables.stride(0), *out.stride()[1:],
    ), dict(
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_Q=launch.block_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=kv_cache.shape[3], TILE_N=launch.tile_n,
        NUM_SEGMENTS=launch.num_segments, IS_CAUSAL=bool(causal), HAS_ALIBI=alibi_slopes is not None,
        HAS_WINDOW=sliding_window > 0, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE=counters is not None, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **fp8_constexprs(kv_cache),  # every constexpr passed: see fp8_constexprs
    )


def _merge_launch(part_acc, part_max, part_sum, out, launch, head_dim, block_d):
    """(kernel, grid, args, constexprs) of the split-KV merge as its own launch (when no counters were had)."""
    T, num_heads = out.shape[2], out.shape[1]
    return _merge_segments_kernel, (T, num_heads), (
        part_acc, part_max, part_sum, out, num_heads, out.stride(1), out.stride(2), out.stride(3),
    ), dict(NUM_SEGMENTS=launch.num_segments, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4)


class _Scratch:
    """The split-KV partials (acc [parts, block_d], max [parts], sum [parts], float32) in one allocation (an eager
    allocation is ~2 µs of host time), each view 16-byte aligned: block_d is a multiple of 16, and the sums start at
    the next multiple of 4 floats."""

    __slots__ = ("acc_end", "max_end", "sums_at", "numel")

    def __init__(self, parts: int, block_d: int) -> None:
        self.acc_end = parts * block_d
        self.max_end = parts * (block_d + 1)
        self.sums_at = self.max_end + (-parts) % 4
        self.numel = self.sums_at + parts

    def views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scratch = torch.empty(self.numel, dtype=torch.float32, device=device)
        return scratch[:self.acc_end], scratch[self.acc_end:self.max_end], scratch[self.sums_at:]


class _PagedPlan:
    """One step shape's attention, prepared once and launched per layer with that layer's tensors (STYLE.md §10).

    Holds the prepared launches (launcher.prepare: on a GPU, cuLaunchKernel with every scalar packed once; under the
    interpreter, the same launch through launcher.launch) and what the call allocates. Valid for any call whose
    inputs match the `PagedLaunchState.plan_key` it is stored under: the key holds everything the launches'
    scalars, grids and constexprs were computed from, and each launch checks its tensors' 16-byte alignment (the
    kernels are specialised on it); a call with another alignment returns None and takes the full path (a KV write
    it already made is made again there, with the same values). Prepared by its state's `launcher`; the workspace
    it keeps between calls is counted in its state's `budget`. An FP8 pool's scales are not in the key: they are
    runtime scalars of the launches (write_kv.py), set per call, so one plan serves every layer whatever its scales
    (as it does a bf16 plan's)."""

    __slots__ = ("kv_write", "attention", "merge", "scratch", "counters", "counters_at", "out_shape", "dtype",
                 "device", "cuda", "rope", "partials_at", "workspace_bytes", "owned", "calls", "budget", "scaled")

    def __init__(self, kv_write, attention, merge, scratch: _Scratch | None, counters: torch.Tensor | None, *,
                 device: torch.device, launcher: Launcher, budget: WorkspaceBudget) -> None:
        launches = [x for x in (kv_write, attention, merge) if x is not None]

        def prepare(x: tuple, direct: bool):  # the CUDA decode kernels prepare their own launches (decode_cuda.py)
            if isinstance(x[0], decode_cuda.NvrtcKernel):
                return x[0].prepare(*x[1:], direct=direct)
            return launcher.prepare(*x, direct=direct)

        prepared = [prepare(x, True) for x in launches]
        direct = all(isinstance(x, DriverLaunch) for x in prepared)
        if not direct:  # all through the driver, or none (a Relaunch needs no stream)
            prepared = [prepare(x, False) for x in launches]
        slots = iter(prepared)
        # None where there is no such launch (kv_write: the pool was written before the call, kv_written)
        self.kv_write, self.attention, self.merge = (None if x is None else next(slots)
                                                     for x in (kv_write, attention, merge))
        # (launch, position of k_scale, of v_scale) of each launch that takes an FP8 pool's scales
        self.scaled = [(run, x[0].arg_names.index("k_scale"), x[0].arg_names.index("v_scale"))
                       for run, x in zip(prepared, launches) if x[3].get("FP8_KV")]
        self.scratch = scratch
        self.counters = counters  # the merge counters (`PagedLaunchState.merge_counters`), or None
        self.counters_at = counters.data_ptr() if counters is not None else None
        out = attention[2][6]
        self.out_shape, self.dtype, self.device = tuple(out.shape), out.dtype, device
        self.rope = kv_write is not None and kv_write[0] is _rope_write_kv_kernel
        # Direct calls' workspace: the rotated q (RoPE fold), then the partials at a 256-byte boundary.
        q_rot_bytes = out.numel() * out.element_size() if self.rope else 0
        self.partials_at = -(-q_rot_bytes // 256) * 256
        self.workspace_bytes = self.partials_at + (4 * scratch.numel if scratch else 0)
        self.owned: tuple[int, torch.Tensor] | None = None  # (stream, workspace) kept by direct calls
        self.cuda = device.index if direct else None  # launch through the driver, on this device's current stream
        self.calls = 0  # calls served (tests and benchmarks)
        self.budget = budget

    def __call__(self, q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes,
                 cos, sin, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor | None:
        """The attention output of this layer's tensors (and, for an FP8 pool, its scales), or None when a launch
        refused them (alignment)."""
        self.calls += 1
        for run, k_at, v_at in self.scaled:
            run.set_scalar(k_at, float(k_scale))
            run.set_scalar(v_at, float(v_scale))
        if self.cuda is not None:
            return self._run_direct(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                                    alibi_slopes, cos, sin)
        stream = 0  # Relaunches launch on the current stream themselves
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.rope:
            q_rot = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            if not self.kv_write(stream, q, k, v, cos, sin, q_rot, kv_cache, slot_mapping):
                return None
            q = q_rot
        elif self.kv_write is not None and not self.kv_write(stream, k, v, kv_cache, slot_mapping):
            return None
        parts = (out, out, out) if self.scratch is None else self.scratch.views(self.device)
        if not self.attention(stream, q, kv_cache, block_tables, seq_lens, query_start_loc,
                              alibi_slopes if alibi_slopes is not None else q, out, *parts,
                              self.counters if self.counters is not None else q):
            return None
        if self.merge is not None and not self.merge(stream, *parts, out):
            return None
        return out

    def _run_direct(self, q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes,
                    cos, sin) -> torch.Tensor | None:
        """__call__ through the driver: each address read once; the rotated q and the split-KV partials, which no
        one reads after the call, live in one workspace (`_workspace`) and are passed as offsets into it."""
        if torch.cuda.current_device() != self.cuda:
            return None  # the kernels were loaded for another device's context
        stream = current_stream(self.cuda)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        o, c, s = out.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr()
        base = self._workspace(stream).data_ptr() if self.workspace_bytes else 0
        if self.rope:
            qa = base
            if not self.kv_write.launch(stream, [q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(),
                                                 sin.data_ptr(), qa, c, s]):
                return None
        else:
            qa = q.data_ptr()
            if self.kv_write is not None and not self.kv_write.launch(stream, [k.data_ptr(), v.data_ptr(), c, s]):
                return None
        if self.scratch is None:
            parts = [o, o, o]
        else:
            at = base + self.partials_at
            parts = [at, at + 4 * self.scratch.acc_end, at + 4 * self.scratch.sums_at]
        if not self.attention.launch(stream, [qa, c, block_tables.data_ptr(), seq_lens.data_ptr(),
                                              query_start_loc.data_ptr(),
                                              qa if alibi_slopes is None else alibi_slopes.data_ptr(), o, *parts,
                                              qa if self.counters_at is None else self.counters_at]):
            return None
        if self.merge is not None and not self.merge.launch(stream, [*parts, o]):
            return None
        return out

    def _workspace(self, stream: int) -> torch.Tensor:
        """The rotated q and the split-KV partials, in one buffer: the plan's own, reused call after call on the
        stream it was first used on (the calls are ordered there, and neither outlives the call that wrote it), or a
        new one on another stream, while a CUDA graph is being captured (the graph must own what it reads), or once
        the plans keep their budget's limit in all (a long prefill's rotated q is megabytes)."""
        capturing = torch.cuda.is_current_stream_capturing()
        if self.owned is not None and self.owned[0] == stream and not capturing:
            return self.owned[1]
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        if self.owned is None and not capturing and self.budget.take(self.workspace_bytes):
            self.owned = (stream, workspace)
        return workspace  # a new one is freed once its launches are queued: stream-ordered, as torch frees


