"""PagedAttention's decode over an FP8 pool as a hand-written CUDA kernel (CUDA C++ compiled at first use by NVRTC,
through cuda-python), launched through the driver like the Triton kernels' prepared launches (launcher.py
`DriverLaunch`). The path `paged_attention_triton` takes, on a GPU, for the steps it serves (`why_not`); every
other step, and every GPU without NVRTC, stays on the Triton kernel (attention.py), which computes the same
attention.

Why hand-written: issue 33 asks FP8 pools to decode at >= 1.7x the bf16 pool's speed (half the bytes). Triton 3.6
widens an FP8 tile through shared memory and issues ~685 instructions a warp per 32 keys, and no Triton variant
passed 1.53x (docs/benchmarks/NOTES.md, "FP8 decode"). This kernel issues 348-412, and measured 1.7-1.9x on an
H200 (docs/benchmarks/attention_h200.json).

How it computes (one CTA of 4 warps per sequence, KV head and key-range segment; each warp takes its own 16-key
blocks, and the warps' softmax partials are merged in shared memory at the end):

- both dots are transposed, so that no row of the m16n8k16 tensor-core tiles is padding: S^T = K . q^T (the 16 keys
  of a block are M, the GROUP <= 8 query heads are N) and O^T = V^T . P^T (head_dim is M);
- the lanes' d order and key order are chosen so that K is read as whole 16-byte pieces of its rows and V as 4-byte
  words of its [head_dim, 16] block rows (the FP8 pool stores values so), each pair widened in its fragment by one
  `cvt.rn.f16x2.e4m3x2`; P^T's fragments come from S^T's accumulators through `movmatrix.trans`;
- q and the probabilities are held in fp16 for the dots (q clamped to fp16's range), the dots accumulate in fp32,
  and the scales multiply the scores and the output, as the Triton kernel's FP8 path does;
- the sums are rescaled only when a running max moved (a warp vote; exact, the factor is 1.0 otherwise).

It serves decode-shaped steps: one grid row per sequence, whose tokens (one in a decode step; any number is
computed right, one after another) attend causally or not, with a sliding window or not. ALiBi, block sizes other
than 16, head sizes other than 64/128/192/256, groups over 8 and fp32 models take the Triton kernel.

A split-KV step's partials are merged by the module's second kernel, fp8_merge_segments. On sm_90+ the step's
launches chain as programmatic dependent launches (`CudaDecodePlan.pdl`): the KV write (write_kv.py,
ALLOW_DEPENDENTS) lets the attention start at once, the attention reads only the step's metadata before
`griddepcontrol.wait` and lets the merge start after its loop, and the merge waits before its first read. At
B1·L32K that took the step from 1.58x to 1.73x bf16 (docs/benchmarks/l2_state_h200.json, NOTES.md).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from trtopt.plugins.launcher import DriverLaunch, Launcher, _driver, current_stream

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

// compiled with -DHEAD_DIM=.. -DGROUP=.. -DQ_BF16=0|1 -DPIPE=0|1 -DASYNC=0|1 -DSTAGES=..
#define BS 16                      // tokens a KV block: the dots' K (scores) and M (keys) size
#define WARPS 4
#define KS (HEAD_DIM / 16)         // k-steps of the QK dot, m-tiles of the PV dot
#define KCHUNK (HEAD_DIM / 64)     // 16-byte pieces a lane reads of each of its two K rows
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 widen2(u32 word) {  // the low two e4m3 of a word -> f16x2, the low byte low
    u32 out;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(out) : "r"(word));
    return out;
}
__device__ __forceinline__ u32 widen2_hi(u32 word) {  // the high two e4m3 of a word -> f16x2
    u32 out;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(out) : "r"(word));
    return out;
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 out;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}
__device__ __forceinline__ float q_to_f32(u16 x) {
#if Q_BF16
    return __uint_as_float(((u32)x) << 16);
#else
    float y;
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x));
    return y;
#endif
}
__device__ __forceinline__ u16 f32_to_q(float x) {
    u16 out;
#if Q_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(x));
#endif
    return out;
}
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void mma4(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(global) : "memory");
}
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Programmatic dependent launch (sm_90+; launcher.DriverLaunch pdl=True): a kernel so launched may start while the
// previous one on its stream runs, and waits here, before its first read, until that kernel has ended and its
// writes are visible; allow_dependents lets the next such launch start early. Both return at once otherwise.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Lane (g, t): g = lane / 4, t = lane % 4. S^T row r holds key 4(r/2) + (r%2) for r < 8 and 4((r-8)/2) + 2 + (r%2)
// for r >= 8, so that after the 8x8 transposes lane t's P^T pairs are keys 4t..4t+3: the 4 bytes it reads of a
// value row. The QK dot's d order: k-step ks, k 2t..2t+1 <-> d (HEAD_DIM/4)t + 4ks + {0,1}, k 2t+8..2t+9 <-> + {2,3}.
struct BlockRegs {       // one 16-key block's bytes as this lane's fragments take them
    uint4 ka[KCHUNK];    // K row of key kg: bytes [(HEAD_DIM/4)t, +HEAD_DIM/4)
    uint4 kb[KCHUNK];    // K row of key kg + 2
    u32 vw[KS][2];       // value rows d = 16mt + g and + 8: bytes [4t, 4t + 4) = keys 4t..4t+3
};

__device__ __forceinline__ void load_block(BlockRegs& r, const unsigned char* kblock, const unsigned char* vblock,
                                           int g, int t) {
    const int kg = 4 * (g >> 1) + (g & 1), kg8 = kg + 2;
    const uint4* pk = reinterpret_cast<const uint4*>(kblock + kg * HEAD_DIM + (HEAD_DIM / 4) * t);
    const uint4* pk8 = reinterpret_cast<const uint4*>(kblock + kg8 * HEAD_DIM + (HEAD_DIM / 4) * t);
    #pragma unroll
    for (int i = 0; i < KCHUNK; ++i) { r.ka[i] = pk[i]; r.kb[i] = pk8[i]; }
    const u32* pv = reinterpret_cast<const u32*>(vblock) + g * (BS / 4) + t;
    #pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
        r.vw[mt][0] = pv[(16 * mt) * (BS / 4)];
        r.vw[mt][1] = pv[(16 * mt + 8) * (BS / 4)];
    }
}

__device__ __forceinline__ u32 word_of(const uint4* chunk, int ks) {  // ks: a compile-time constant once unrolled
    const uint4 c = chunk[ks >> 2];
    const int i = ks & 3;
    return i == 0 ? c.x : (i == 1 ? c.y : (i == 2 ? c.z : c.w));
}

// FULL: every key of the block is in [lo, hi); else the others are masked (scores -inf, value bytes zeroed: a slot
// not written yet may hold NaN).
template <bool FULL>
__device__ __forceinline__ void attend_block(
    const BlockRegs& r, int key0, int lo, int hi, float score_scale,
    const u32 (&qb)[KS][2], float (&acc)[KS][4], float (&m)[2], float (&l)[2], int g, int t)
{
    const int kg = 4 * (g >> 1) + (g & 1), kg8 = kg + 2;
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // (key row g: cols 2t, 2t+1), (key row g+8: cols 2t, 2t+1)
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const u32 wa = word_of(r.ka, ks), wb = word_of(r.kb, ks);
        mma4(s, widen2(wa), widen2(wb), widen2_hi(wa), widen2_hi(wb), qb[ks][0], qb[ks][1]);
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        s[i] *= score_scale;
        if (!FULL) {
            const int key = key0 + (i < 2 ? kg : kg8);
            s[i] = key >= lo && key < hi ? s[i] : NEG_INF;
        }
    }
    // per column (query head 2t + c): the max over the block's 16 keys (rows: lanes g, and within the thread)
    float alpha[2];
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        float x = fmaxf(s[c], s[c + 2]);
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 16));
        const float mx = fmaxf(m[c], x);
        alpha[c] = ex2(m[c] - mx);
        m[c] = mx;
        s[c] = ex2(s[c] - mx);
        s[c + 2] = ex2(s[c + 2] - mx);
        l[c] = l[c] * alpha[c] + s[c] + s[c + 2];  // this lane's part; summed over g at the end
    }
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
        #pragma unroll
        for (int mt = 0; mt < KS; ++mt) {
            acc[mt][0] *= alpha[0]; acc[mt][1] *= alpha[1]; acc[mt][2] *= alpha[0]; acc[mt][3] *= alpha[1];
        }
    }
    // P^T as the B fragment: the two 8x8 f16 halves of S^T (rows 0..7, rows 8..15), transposed
    const u32 pb0 = transpose8x8(pack_f16x2(s[0], s[1]));
    const u32 pb1 = transpose8x8(pack_f16x2(s[2], s[3]));
    u32 keep = 0xffffffffu;
    if (!FULL) {  // this lane's keys key0 + 4t + j, j < 4: keep the bytes of those in [lo, hi)
        const int first = key0 + 4 * t;
        const int a = min(max(lo - first, 0), 4), b = min(max(hi - first, 0), 4);
        const u32 below_b = b >= 4 ? 0xffffffffu : ((1u << (8 * b)) - 1u);
        const u32 below_a = a >= 4 ? 0xffffffffu : ((1u << (8 * a)) - 1u);
        keep = below_b & ~below_a;
    }
    #pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
        const u32 w0 = r.vw[mt][0] & keep, w1 = r.vw[mt][1] & keep;
        mma4(acc[mt], widen2(w0), widen2(w1), widen2_hi(w0), widen2_hi(w1), pb0, pb1);
    }
}

extern "C" __global__ void __launch_bounds__(128, 2) fp8_paged_decode(
    const u16* __restrict__ Q,                 // [1, Hq, T, HEAD_DIM], bf16 or fp16
    const unsigned char* __restrict__ Cache,   // e4m3 [num_blocks, 2, Hkv, 16, HEAD_DIM], values [HEAD_DIM, 16]
    const int* __restrict__ BlockTables, const int* __restrict__ SeqLens, const int* __restrict__ QueryStartLoc,
    const void* unused_alibi,
    u16* __restrict__ Out,                     // [1, Hq, T, HEAD_DIM], q's dtype
    float* __restrict__ PartAcc, float* __restrict__ PartMax, float* __restrict__ PartSum,
    const void* unused_counters,
    float score_scale,                         // softmax scale * log2(e)
    float k_scale, float v_scale, int causal, int window,
    long long stride_qh, long long stride_qt, long long stride_cb, long long stride_ckv, long long stride_ch,
    long long stride_bt, long long stride_oh, long long stride_ot, int num_heads, int part_stride)
{
    // grid (sequences, Hkv, segments). With more than one segment each CTA takes its part of every token's key
    // range and writes the partials [token, head, segment] (max in log2 units, sum, v_scale-scaled acc at
    // part_stride floats a part) as fp8_merge_segments (below) reads them.
    const int seq = blockIdx.x, kvh = blockIdx.y, seg = blockIdx.z, segments = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tok_begin = QueryStartLoc[seq], tok_end = QueryStartLoc[seq + 1];
    const int seq_len = SeqLens[seq];
    const int* table = BlockTables + seq * stride_bt;
    const unsigned char* head = Cache + kvh * stride_ch;
    const float ss = score_scale * k_scale;
    __shared__ float sm_m[WARPS][GROUP], sm_l[WARPS][GROUP];
    // dynamic: ASYNC's staging ([WARPS][STAGES][2][BS * HEAD_DIM] bytes), then (aliased) the warps' sums
    extern __shared__ __align__(16) unsigned char dyn[];
    float (*sm_acc)[GROUP][HEAD_DIM] = reinterpret_cast<float (*)[GROUP][HEAD_DIM]>(dyn);

    for (int tok = tok_begin; tok < tok_end; ++tok) {
        const int pos = seq_len - (tok_end - tok);  // this token's position
        const int hi = causal ? pos + 1 : seq_len;
        const int lo = window > 0 ? max(pos - window + 1, 0) : 0;

        // blocks [blk_lo, blk_hi) hold keys [lo, hi), split evenly over the segments; those wholly inside [lo, hi)
        // are walked by the warps in turn, the (at most two) partial ones at the ends are masked
        const int blk_lo = lo / BS, blk_hi = (hi + BS - 1) / BS;
        const int per_seg = (blk_hi - blk_lo + segments - 1) / segments;
        const int s_lo = blk_lo + seg * per_seg, s_hi = min(s_lo + per_seg, blk_hi);
        const int full_lo = max(s_lo, (lo + BS - 1) / BS), full_hi = min(s_hi, hi / BS);
        auto load = [&](BlockRegs& r, int phys) {  // the bytes of physical block `phys` of this KV head
            const unsigned char* kb = head + phys * stride_cb;
            load_block(r, kb, kb + stride_ckv, g, t);
        };
        // Each warp reads the table entry of its block after next ahead of time: its latency overlaps this block's
        // loads, instead of coming before them on every block.
        auto phys_of = [&](int block) { return block < full_hi ? table[block] : 0; };
        int b = full_lo + warp;
        BlockRegs r0;
        // Up to here the kernel has read only the step's metadata, which no kernel writes right before this one;
        // q and the pool come after the previous kernel's end (the KV write: the pool's newest slot, and the
        // rotated q when RoPE is folded into it), when launched as a programmatic dependent.
#if ASYNC
        // cp.async into STAGES per-warp stages: STAGES - 1 blocks in flight while one is computed, in no registers.
        // The first STAGES - 1 blocks' table entries are read before the wait, and their loads issued before q is
        // read, so that those latencies overlap the previous kernel and q's.
        unsigned char* stages = dyn + warp * (STAGES * 2 * BS * HEAD_DIM);
        const int n = full_hi > b ? (full_hi - b + WARPS - 1) / WARPS : 0;
        auto issue_from = [&](int i, int phys) {
            if (i < n) {
                const unsigned char* kb = head + phys * stride_cb;
                unsigned char* dst = stages + (i % STAGES) * (2 * BS * HEAD_DIM);
                #pragma unroll
                for (int j = lane; j < BS * HEAD_DIM / 16; j += 32) {
                    cp_async16(dst + 16 * j, kb + 16 * j);
                    cp_async16(dst + BS * HEAD_DIM + 16 * j, kb + stride_ckv + 16 * j);
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
        auto issue = [&](int i) { issue_from(i, i < n ? table[b + WARPS * i] : 0); };
        int first[STAGES - 1];
        #pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) first[i] = i < n ? table[b + WARPS * i] : 0;
        grid_dependency_wait();
        #pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) issue_from(i, first[i]);
#else
        grid_dependency_wait();
#endif
        // q^T's B fragments: column n = g is query head g (< GROUP); k 2t..2t+1 <-> d (HEAD_DIM/4)t + 4ks + {0,1}
        u32 qb[KS][2];
        {
            float qv[HEAD_DIM / 4];
            if (g < GROUP) {
                const u16* qrow = Q + (kvh * GROUP + g) * stride_qh + tok * stride_qt + (HEAD_DIM / 4) * t;
                #pragma unroll
                for (int i = 0; i < HEAD_DIM / 4; i += 8) {
                    const uint4 w = *reinterpret_cast<const uint4*>(qrow + i);
                    const u32 ws[4] = {w.x, w.y, w.z, w.w};
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        qv[i + 2 * j] = q_to_f32(ws[j] & 0xffff);
                        qv[i + 2 * j + 1] = q_to_f32(ws[j] >> 16);
                    }
                }
            } else {
                #pragma unroll
                for (int i = 0; i < HEAD_DIM / 4; ++i) qv[i] = 0.f;
            }
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) qv[4 * ks + j] = fminf(fmaxf(qv[4 * ks + j], -65504.f), 65504.f);
                qb[ks][0] = pack_f16x2(qv[4 * ks], qv[4 * ks + 1]);
                qb[ks][1] = pack_f16x2(qv[4 * ks + 2], qv[4 * ks + 3]);
            }
        }
        float acc[KS][4];
        #pragma unroll
        for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
#if ASYNC
        for (int i = 0; i < n; ++i) {
            issue(i + STAGES - 1);
            asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
            __syncwarp();
            const unsigned char* kb = stages + (i % STAGES) * (2 * BS * HEAD_DIM);
            load_block(r0, kb, kb + BS * HEAD_DIM, g, t);
            __syncwarp();  // every lane has read the stage before the next issue overwrites it
            attend_block<true>(r0, (b + WARPS * i) * BS, lo, hi, ss, qb, acc, m, l, g, t);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
#elif PIPE
        BlockRegs r1;  // two register sets: the next block's loads are in flight while this one is computed
        int ahead = phys_of(b + WARPS);
        if (b < full_hi) load(r0, table[b]);
        while (b < full_hi) {
            const int b1 = b + WARPS, p1 = ahead;
            ahead = phys_of(b1 + WARPS);
            if (b1 < full_hi) load(r1, p1);
            attend_block<true>(r0, b * BS, lo, hi, ss, qb, acc, m, l, g, t);
            b = b1;
            if (b >= full_hi) break;
            const int b2 = b + WARPS, p2 = ahead;
            ahead = phys_of(b2 + WARPS);
            if (b2 < full_hi) load(r0, p2);
            attend_block<true>(r1, b * BS, lo, hi, ss, qb, acc, m, l, g, t);
            b = b2;
        }
#else
        int ahead = phys_of(b);
        for (; b < full_hi; b += WARPS) {
            const int phys = ahead;
            ahead = phys_of(b + WARPS);
            load(r0, phys);
            attend_block<true>(r0, b * BS, lo, hi, ss, qb, acc, m, l, g, t);
        }
#endif
        const int head_blk = lo % BS ? lo / BS : -1;
        int tail_blk = hi % BS ? hi / BS : -1;
        if (tail_blk == head_blk) tail_blk = -1;
        if (warp == 0 && head_blk >= s_lo && head_blk < s_hi) {
            load(r0, table[head_blk]);
            attend_block<false>(r0, head_blk * BS, lo, hi, ss, qb, acc, m, l, g, t);
        }
        if (warp == WARPS - 1 && tail_blk >= s_lo && tail_blk < s_hi) {
            load(r0, table[tail_blk]);
            attend_block<false>(r0, tail_blk * BS, lo, hi, ss, qb, acc, m, l, g, t);
        }

        allow_dependents();  // the merge launch may start (it waits for this grid to end before reading)
        __syncthreads();  // the sums alias ASYNC's stages: every warp is done with them
        // column c of lane (g, t) is query head 2t + c; acc[mt] = (d 16mt + g: c0, c1), (d 16mt + g + 8: c2, c3)
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            l[c] += __shfl_xor_sync(0xffffffff, l[c], 4);
            l[c] += __shfl_xor_sync(0xffffffff, l[c], 8);
            l[c] += __shfl_xor_sync(0xffffffff, l[c], 16);
        }
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int h = 2 * t + c;
            if (h < GROUP) {
                if (g == 0) { sm_m[warp][h] = m[c]; sm_l[warp][h] = l[c]; }
                #pragma unroll
                for (int mt = 0; mt < KS; ++mt) {
                    sm_acc[warp][h][16 * mt + g] = acc[mt][c];
                    sm_acc[warp][h][16 * mt + g + 8] = acc[mt][c + 2];
                }
            }
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < GROUP * (HEAD_DIM / 4); idx += WARPS * 32) {
            const int r = idx / (HEAD_DIM / 4), d0 = 4 * (idx % (HEAD_DIM / 4));
            float mm = -1e30f;
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w][r]);
            float den = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = ex2(sm_m[w][r] - mm);
                den += f * sm_l[w][r];
                #pragma unroll
                for (int i = 0; i < 4; ++i) o[i] += f * sm_acc[w][r][d0 + i];
            }
            if (segments > 1) {
                const long long part = ((long long)tok * num_heads + kvh * GROUP + r) * segments + seg;
                if (d0 == 0) { PartMax[part] = mm; PartSum[part] = den; }
                #pragma unroll
                for (int i = 0; i < 4; ++i) PartAcc[part * part_stride + d0 + i] = o[i] * v_scale;
            } else {
                const float inv = den > 0.f ? v_scale / den : 0.f;
                u16* orow = Out + (kvh * GROUP + r) * stride_oh + tok * stride_ot + d0;
                #pragma unroll
                for (int i = 0; i < 4; ++i) orow[i] = f32_to_q(o[i] * inv);
            }
        }
        __syncthreads();  // the next token reuses the shared partials
    }
}

// The split-KV merge of fp8_paged_decode's partials, as attention.py's _merge_segments_kernel computes it (one CTA
// a token and query head): out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s. Launched as a programmatic
// dependent of the attention launch, so that its launch overlaps that kernel's end. Every load is issued before
// the first is used (thread s reads segment s's max and sum; the threads' stripes read 16-byte pieces of up to
// MERGE_AHEAD segments' acc rows each), so that the merge waits about one L2 round trip.
#define MERGE_THREADS 128
#define MERGE_AHEAD 16
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) fp8_merge_segments(
    const float* __restrict__ PartAcc, const float* __restrict__ PartMax, const float* __restrict__ PartSum,
    u16* __restrict__ Out, int num_heads, long long stride_oh, long long stride_ot, int segments, int part_stride)
{
    constexpr int D4 = HEAD_DIM / 4, STRIPES = MERGE_THREADS / D4;  // a stripe's threads hold a row's d / 4
    __shared__ float sm_w[MERGE_THREADS];                              // segments <= 128: segment s's weight
    __shared__ float sm_red[2][MERGE_THREADS / 32];
    __shared__ float4 sm_o[STRIPES][D4];
    const int s = threadIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col = threadIdx.x % D4, stripe = threadIdx.x / D4;
    grid_dependency_wait();
    const long long tok = blockIdx.x;
    const int h = blockIdx.y;
    const long long base = (tok * num_heads + h) * segments;
    const float ms = s < segments ? __ldcg(PartMax + base + s) : NEG_INF;
    const float ls = s < segments ? __ldcg(PartSum + base + s) : 0.f;
    float4 ahead[MERGE_AHEAD];
    #pragma unroll
    for (int i = 0; i < MERGE_AHEAD; ++i) {
        const int si = stripe + i * STRIPES;
        ahead[i] = stripe < STRIPES && si < segments
            ? __ldcg(reinterpret_cast<const float4*>(PartAcc + (base + si) * part_stride) + col)
            : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float x = ms;
    #pragma unroll
    for (int k = 16; k > 0; k >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, k));
    if (lane == 0) sm_red[0][warp] = x;
    __syncthreads();
    float mx = sm_red[0][0];
    #pragma unroll
    for (int w = 1; w < MERGE_THREADS / 32; ++w) mx = fmaxf(mx, sm_red[0][w]);
    const float ws = s < segments ? ex2(ms - mx) : 0.f;
    float y = ws * ls;
    #pragma unroll
    for (int k = 16; k > 0; k >>= 1) y += __shfl_xor_sync(0xffffffff, y, k);
    if (lane == 0) sm_red[1][warp] = y;
    sm_w[s] = ws;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int w = 0; w < MERGE_THREADS / 32; ++w) total += sm_red[1][w];
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (stripe < STRIPES) {
        #pragma unroll
        for (int i = 0; i < MERGE_AHEAD; ++i) {
            const int si = stripe + i * STRIPES;
            const float wi = si < segments ? sm_w[si] : 0.f;
            o.x += wi * ahead[i].x; o.y += wi * ahead[i].y; o.z += wi * ahead[i].z; o.w += wi * ahead[i].w;
        }
        for (int si = stripe + MERGE_AHEAD * STRIPES; si < segments; si += STRIPES) {
            const float4 a = __ldcg(reinterpret_cast<const float4*>(PartAcc + (base + si) * part_stride) + col);
            const float wi = sm_w[si];
            o.x += wi * a.x; o.y += wi * a.y; o.z += wi * a.z; o.w += wi * a.w;
        }
        sm_o[stripe][col] = o;
    }
    __syncthreads();
    if (stripe == 0) {
        #pragma unroll
        for (int k = 1; k < STRIPES; ++k) {
            const float4 b = sm_o[k][col];
            o.x += b.x; o.y += b.y; o.z += b.z; o.w += b.w;
        }
        const float den = total == 0.f ? 1.f : total;
        u16* orow = Out + h * stride_oh + tok * stride_ot + 4 * col;
        orow[0] = f32_to_q(o.x / den); orow[1] = f32_to_q(o.y / den);
        orow[2] = f32_to_q(o.z / den); orow[3] = f32_to_q(o.w / den);
    }
}
"""

HEAD_DIMS = (64, 128, 192, 256)
MAX_GROUP = 8  # the query heads of a KV head are the dots' N = 8 columns
BLOCK_SIZE = 16
WARPS = 4
THREADS = 32 * WARPS
# The kernel's parameters in order: the 11 pointers of the Triton attention kernel's launch (attention.py
# `_attention_launch`, so that a plan passes both the same addresses), then its scalars.
ARG_NAMES = ("q", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "alibi_slopes", "out", "part_acc",
             "part_max", "part_sum", "counters", "score_scale", "k_scale", "v_scale", "causal", "window",
             "stride_qh", "stride_qt", "stride_cb", "stride_ckv", "stride_ch", "stride_bt", "stride_oh",
             "stride_ot", "num_heads", "part_stride")
# fp8_merge_segments's parameters (the merge's 4 pointers as attention.py's merge launch passes them, then scalars)
MERGE_ARG_NAMES = ("part_acc", "part_max", "part_sum", "out", "num_heads", "stride_oh", "stride_ot", "segments",
                   "part_stride")
MERGE_THREADS = 128
_SCALAR_TYPES = {"score_scale": ctypes.c_float, "k_scale": ctypes.c_float, "v_scale": ctypes.c_float,
                 "causal": ctypes.c_int32, "window": ctypes.c_int32, "num_heads": ctypes.c_int32,
                 "part_stride": ctypes.c_int32, "segments": ctypes.c_int32}  # the strides are int64


@dataclass(frozen=True)
class CudaDecodePlan:
    """How one decode step is launched: key-range segments (flash-decoding; merged by fp8_merge_segments, a second
    launch), how each warp keeps its next blocks' loads in flight (`stages` > 1 stages them in shared memory through
    cp.async, stages - 1 blocks in flight, else `pipe` double-buffers them in registers, else none), and whether
    the launches are programmatic dependent launches (`pdl`)."""

    num_segments: int
    pipe: bool = False
    stages: int = 0
    # Launch the attention kernel and the split-KV merge as programmatic dependent launches (sm_90+): each starts
    # while the kernel before it ends, and waits before its first read (launcher.DriverLaunch `pdl`).
    pdl: bool = True

    def __post_init__(self) -> None:
        # the merge kernel takes at most 128 segments (a thread each), the plans make powers of two; stages and
        # registers are two ways to the same end
        if self.num_segments < 1 or self.num_segments & (self.num_segments - 1) or self.num_segments > 128:
            raise ValueError(f"num_segments must be a power of two in [1, 128]; got {self.num_segments}")
        if self.stages not in (0, 2, 3, 4) or (self.pipe and self.stages):
            raise ValueError(f"stages must be 0 (none), 2, 3 or 4, and not with pipe; got stages={self.stages}, "
                             f"pipe={self.pipe}")


def shared_bytes(head_dim: int, group: int, stages: int) -> int:
    """The kernel's dynamic shared memory: the cp.async stages, which the warps' sums alias after the loop."""
    return max(WARPS * stages * 2 * BLOCK_SIZE * head_dim, WARPS * group * head_dim * 4)


def plan_cuda_decode(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int,
                     head_dim: int = 128) -> CudaDecodePlan:
    """Segments and how loads stay in flight, from shapes. The H200 sweep (docs/benchmarks/
    fp8_cuda_decode_sweep_h200.json: 8 shapes × every segment count × registers, PIPE or 2-4 cp.async stages,
    graph replays) ran fastest, or within 3.5% of it (2 stages led several shapes by 0.3-3.4%, within the
    run-to-run spread), at 3 cp.async stages for head_dim <= 128 (PIPE for larger heads, whose stages would take
    96 KB a CTA) and with the key range split while the grid stays within three CTAs an SM, each segment keeping
    >= 128 keys, up to 64 segments."""
    ctas = max(num_seqs * num_kv_heads, 1)
    segments = 1
    while segments < 64 and ctas * segments * 2 <= 3 * sm_count and max_context >= segments * 2 * 128:
        segments *= 2
    if head_dim <= 128:
        return CudaDecodePlan(num_segments=segments, stages=3)
    return CudaDecodePlan(num_segments=segments, pipe=True)


def why_not(q: torch.Tensor, kv_cache: torch.Tensor, *, num_tokens: int, num_seqs: int, group: int, head_dim: int,
            alibi_slopes: torch.Tensor | None, launcher: Launcher) -> str | None:
    """None when this kernel serves the step, else why the Triton kernel does. Pure host checks (no sync): a
    decode-shaped step (as many tokens as sequences) of a 16-bit model over an FP8 pool of 16-token blocks, on a
    GPU of compute capability >= 8.9 (e4m3 conversions), through the driver, with NVRTC to compile it."""
    if kv_cache.dtype != torch.float8_e4m3fn or q.device.type != "cuda":
        return "not an FP8 pool on a GPU"
    if num_tokens != num_seqs:
        return "not a decode step"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype}"
    if head_dim not in HEAD_DIMS or group > MAX_GROUP or kv_cache.shape[3] != BLOCK_SIZE:
        return f"head_dim {head_dim}, group {group}, block size {kv_cache.shape[3]}"
    if alibi_slopes is not None:
        return "ALiBi"
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim or any(s % 16 for s in kv_cache.stride()[:3]):
        return "the pool's block planes are not contiguous 16-byte-aligned"
    if q.stride(3) != 1 or q.stride(1) % 8 or q.stride(2) % 8 or q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "q or the pool is not 16-byte aligned"
    if launcher.dispatcher_only or _driver() is None or torch.cuda.get_device_capability(q.device) < (8, 9):
        return "no direct driver launch, or a GPU without e4m3 conversions"
    if _nvrtc_error() is not None:
        return f"NVRTC: {_nvrtc_error()}"
    return None


def choose(q: torch.Tensor, kv_cache: torch.Tensor, *, num_tokens: int, num_seqs: int, group: int, head_dim: int,
           alibi_slopes: torch.Tensor | None, launcher: Launcher, max_context: int, sm_count: int,
           forced: CudaDecodePlan | None = None) -> CudaDecodePlan | None:
    """The plan this kernel attends the step with (`forced`, else `plan_cuda_decode`'s), or None where the Triton
    kernel does: where `why_not` gives a reason, or where this configuration does not compile or load (an NVRTC
    that does not know the GPU). A forced plan the kernel cannot serve is a ValueError saying why."""
    reason = why_not(q, kv_cache, num_tokens=num_tokens, num_seqs=num_seqs, group=group, head_dim=head_dim,
                     alibi_slopes=alibi_slopes, launcher=launcher)
    plan = forced if forced is not None else plan_cuda_decode(num_seqs, kv_cache.shape[2], max_context, sm_count,
                                                                head_dim)
    if reason is None:
        try:
            _loaded(q.device.index, head_dim, group, q.dtype == torch.bfloat16, plan.pipe, plan.stages)
        except RuntimeError as e:
            reason = str(e)
    if reason is None:
        return plan
    if forced is not None:
        raise ValueError(f"launch={forced} asks for the CUDA decode kernel, which does not serve this step: {reason}")
    return None


@functools.cache
def _nvrtc_error() -> str | None:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        return None if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else repr(err)
    except (ImportError, RuntimeError, OSError) as e:  # cuda-python without libnvrtc
        return str(e) or type(e).__name__


@functools.cache
def compile_cubin(arch: str, head_dim: int, group: int, q_bf16: bool, pipe: bool, stages: int = 0) -> bytes:
    """The kernel for one configuration, compiled by NVRTC for `arch` (e.g. sm_90a): once a process."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"fp8_paged_decode.cu", 0, [], [])
    options = [f"-arch={arch}".encode(), b"--std=c++17", f"-DHEAD_DIM={head_dim}".encode(),
               f"-DGROUP={group}".encode(), f"-DQ_BF16={int(q_bf16)}".encode(), f"-DPIPE={int(pipe)}".encode(),
               f"-DASYNC={int(stages > 1)}".encode(), f"-DSTAGES={max(stages, 1)}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile fp8_paged_decode for {arch}: {log.decode(errors='replace')}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


@functools.cache
def _loaded(device: int, head_dim: int, group: int, q_bf16: bool, pipe: bool,
            stages: int) -> tuple[object, object, object]:
    """(CUmodule, the attention's CUfunction, the merge's) of one configuration in `device`'s primary context
    (torch's, current here): a memo of the driver's answer, loaded once a process (the module is kept with its
    functions)."""
    from cuda.bindings import driver

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    err, module = driver.cuModuleLoadData(compile_cubin(arch, head_dim, group, q_bf16, pipe, stages))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuModuleLoadData failed for fp8_paged_decode: {err!r}")
    functions = []
    for name in (b"fp8_paged_decode", b"fp8_merge_segments"):
        err, function = driver.cuModuleGetFunction(module, name)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuModuleGetFunction failed for {name.decode()}: {err!r}")
        functions.append(function)
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuFuncSetAttribute(functions[0], attribute, shared_bytes(head_dim, group, stages))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuFuncSetAttribute failed for fp8_paged_decode: {err!r}")
    return module, *functions


class NvrtcKernel:
    """One of this module's kernels, of one configuration, as attention.py's launch tuples hold kernels:
    (kernel, grid, args, constexprs). `prepare` makes the DriverLaunch; `arg_names` lets a plan set each call's
    scales (attention.py `_PagedPlan.scaled`, for launches whose constexprs hold FP8_KV)."""

    arg_names: tuple[str, ...]
    function_index: int  # in `_loaded`'s answer
    threads: int

    def __init__(self, head_dim: int, group: int, q_bf16: bool, plan: CudaDecodePlan) -> None:
        self.config = (head_dim, group, q_bf16, plan.pipe, plan.stages)
        self.shared = 0
        self.pdl = plan.pdl

    def prepare(self, grid: tuple[int, int, int], args: tuple, kwargs: dict, *,
                direct: bool = True) -> DriverLaunch | "OnCurrentStream":
        """The launch, with its scalars packed once; direct=False wraps it to launch on the current stream (what a
        plan's Relaunches do)."""
        device = torch.cuda.current_device()
        kinds, positions = [], []
        for i, (name, value) in enumerate(zip(self.arg_names, args)):
            if isinstance(value, torch.Tensor):
                kinds.append(("*", None))
            else:
                kinds.append(("s", _SCALAR_TYPES.get(name, ctypes.c_int64)(value)))
                positions.append(i)
        # the kernel's own needs (q and the pool 16-byte aligned) are why_not's; the launch compares each address's
        # alignment with the prepared one's, so a later call whose metadata sits otherwise is prepared anew
        aligned = [a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor)]
        function = int(_loaded(device, *self.config)[self.function_index])
        pdl = self.pdl and torch.cuda.get_device_capability(device)[0] >= 9
        run = DriverLaunch(self.name, function, (*grid, self.threads, 1, 1, self.shared), device, kinds, aligned,
                           0, positions, pdl=pdl)
        return run if direct else OnCurrentStream(run)

    def launch(self, grid: tuple[int, int, int], args: tuple, kwargs: dict) -> None:
        """Prepare and launch once on the current stream, with args' own tensors (an eager call)."""
        run = self.prepare(grid, args, kwargs)
        if not run(current_stream(run.device), *[a for a in args if isinstance(a, torch.Tensor)]):
            raise AssertionError(f"{self.name} refused the tensors it was prepared from")  # a bug, not input


class CudaDecode(NvrtcKernel):
    """fp8_paged_decode: the attention."""

    name = "fp8_paged_decode"
    arg_names = ARG_NAMES
    function_index = 1
    threads = THREADS

    def __init__(self, head_dim: int, group: int, q_bf16: bool, plan: CudaDecodePlan) -> None:
        super().__init__(head_dim, group, q_bf16, plan)
        self.shared = shared_bytes(head_dim, group, plan.stages)


class CudaMerge(NvrtcKernel):
    """fp8_merge_segments: the split-KV merge after a CudaDecode of more than one segment."""

    name = "fp8_merge_segments"
    arg_names = MERGE_ARG_NAMES
    function_index = 2
    threads = MERGE_THREADS


class OnCurrentStream:
    """A DriverLaunch called as a Relaunch is (`run(stream, *tensors)`, the stream ignored): it launches on torch's
    current stream of its device."""

    __slots__ = ("run",)

    def __init__(self, run: DriverLaunch) -> None:
        self.run = run

    def set_scalar(self, position: int, value: int | float) -> None:
        self.run.set_scalar(position, value)

    def __call__(self, stream: int, *tensors: torch.Tensor) -> bool:
        return self.run.launch(current_stream(self.run.device), [t.data_ptr() for t in tensors])


def cuda_decode_launch(q, kv_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_max, part_sum, *,
                       score_scale: float, causal: int, sliding_window: int, plan: CudaDecodePlan, group: int,
                       head_dim: int, part_stride: int, scales: tuple[float, float]) -> tuple:
    """(CudaDecode, grid, args, constexprs) of one step, in attention.py `_attention_launch`'s form; score_scale is
    the softmax scale × log2(e), as that kernel takes it."""
    kernel = CudaDecode(head_dim, group, q.dtype == torch.bfloat16, plan)
    grid = (seq_lens.shape[0], kv_cache.shape[2], plan.num_segments)
    args = (q, kv_cache, block_tables, seq_lens, query_start_loc, q, out, part_acc, part_max, part_sum, q,
            score_scale, *scales, int(causal), int(sliding_window), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0), out.stride(1),
            out.stride(2), q.shape[1], part_stride)
    return kernel, grid, args, {"FP8_KV": True}


def cuda_merge_launch(part_acc, part_max, part_sum, out, *, plan: CudaDecodePlan, group: int, head_dim: int,
                      part_stride: int) -> tuple:
    """(CudaMerge, grid, args, constexprs) of the merge after `cuda_decode_launch`'s split launch (the same
    configuration's module: out is q's dtype)."""
    kernel = CudaMerge(head_dim, group, out.dtype == torch.bfloat16, plan)
    T, num_heads = out.shape[2], out.shape[1]
    args = (part_acc, part_max, part_sum, out, num_heads, out.stride(1), out.stride(2), plan.num_segments,
            part_stride)
    return kernel, (T, num_heads, 1), args, {}
