"""Probe (session 33, not part of trtopt's runtime): a hand-written FP8 paged decode kernel (CUDA C++ through
cuda-python's NVRTC), for issue 33's 1.7x attention target, which no Triton 3.6 variant reached
(docs/benchmarks/NOTES.md). Not yet run on a GPU: the CUDA is unchecked there; --emulate checks the design.

Decode only (one query token a sequence), GROUP = 4 query heads a KV head, D = 128, block_size = 16, FP8 pool
[num_blocks, 2, Hkv, 16, 128] with each block's values stored [D, 16]; split-KV (partials merged by attention.py's
merge kernel); no sliding window or ALiBi.

    python benchmarks/probe_fp8_decode_cuda.py --emulate   # CPU: the fragment bookkeeping in numpy vs attention
    python benchmarks/probe_fp8_decode_cuda.py --offline   # no GPU: compile for sm_90a, registers, the loop's SASS
    python benchmarks/probe_fp8_decode_cuda.py --out X.json  # GPU: check against the reference, time vs Triton

--offline needs NVRTC (pip install cuda-bindings nvidia-cuda-nvrtc) and Triton's bundled nvdisasm.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 widen2(u32 pair16) {  // two e4m3 (low 16 bits) -> f16x2, the low byte low
    u32 out;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(out) : "r"(pair16));
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
__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
    return out;
}
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#define D 128
#define BS 16
#define GROUP 4
#define WARPS 4
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void mma4(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Transposed: S^T = K . q^T (keys are M: all 16 rows used; the 4 query heads are N, columns 0..3 of 8) and
// O^T = V^T . P^T (d is M). Lane (g, t): g = lane / 4, t = lane % 4.
// Key order inside a 16-key block: S^T row r holds key 4(r/2) + (r%2) for r < 8 and 4((r-8)/2) + 2 + (r%2) for
// r >= 8, so that after the 8x8 transposes lane t's P^T pairs are keys 4t..4t+3, the 4 bytes it reads of a V row.
// The d order of the QK dot: k-step ks, k 2t..2t+1 <-> d 32t + 4ks + {0,1}, k 2t+8..2t+9 <-> d 32t + 4ks + {2,3}.
struct BlockRegs {  // one 16-key block's bytes as this lane's fragments need them
    uint4 a_lo, a_hi, b_lo, b_hi;  // K rows g and g + 8, bytes [32t, 32t + 32)
    u32 vw[8][2];                  // V rows d = 16 mt + g and + 8, bytes [4t, 4t + 4) = keys 4t..4t+3
};

__device__ __forceinline__ void load_block(BlockRegs& r, const unsigned char* kblock, const unsigned char* vblock,
                                           int g, int t) {
    const int kg = 4 * (g >> 1) + (g & 1), kg8 = kg + 2;
    const uint4* pk = reinterpret_cast<const uint4*>(kblock + kg * D + 32 * t);
    const uint4* pk8 = reinterpret_cast<const uint4*>(kblock + kg8 * D + 32 * t);
    r.a_lo = pk[0]; r.a_hi = pk[1]; r.b_lo = pk8[0]; r.b_hi = pk8[1];
    const u32* pv = reinterpret_cast<const u32*>(vblock) + g * (BS / 4) + t;
    #pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
        r.vw[mt][0] = pv[(16 * mt) * (BS / 4)];
        r.vw[mt][1] = pv[(16 * mt + 8) * (BS / 4)];
    }
}

template <bool FULL>
__device__ __forceinline__ void attend_block(
    const BlockRegs& r, int key0, int seq_len, float score_scale,
    const u32 (&qb)[8][2], float (&acc)[8][4], float (&m)[2], float (&l)[2], int g, int t)
{
    const int kg = 4 * (g >> 1) + (g & 1), kg8 = kg + 2;
    const u32 wa[8] = {r.a_lo.x, r.a_lo.y, r.a_lo.z, r.a_lo.w, r.a_hi.x, r.a_hi.y, r.a_hi.z, r.a_hi.w};
    const u32 wb[8] = {r.b_lo.x, r.b_lo.y, r.b_lo.z, r.b_lo.w, r.b_hi.x, r.b_hi.y, r.b_hi.z, r.b_hi.w};
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // (key row g: cols 2t, 2t+1), (key row g+8: cols 2t, 2t+1)
    #pragma unroll
    for (int ks = 0; ks < 8; ++ks)
        mma4(s, widen2(wa[ks]), widen2(wb[ks]), widen2_hi(wa[ks]), widen2_hi(wb[ks]), qb[ks][0], qb[ks][1]);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        s[i] *= score_scale;
        if (!FULL) s[i] = key0 + (i < 2 ? kg : kg8) < seq_len ? s[i] : NEG_INF;
    }
    // per column (query head 2t + c): max over the block's 16 keys (rows: lanes g, and within the thread)
    float mx[2], alpha[2];
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        float x = fmaxf(s[c], s[c + 2]);
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 16));
        mx[c] = fmaxf(m[c], x);
        alpha[c] = ex2(m[c] - mx[c]);
        m[c] = mx[c];
        s[c] = ex2(s[c] - mx[c]);
        s[c + 2] = ex2(s[c + 2] - mx[c]);
        l[c] = l[c] * alpha[c] + s[c] + s[c + 2];  // this lane's part; summed over g at the end
    }
    // the sums are rescaled only when some column's running max moved (exact: alpha is 1.0 otherwise); past the
    // first blocks of a sequence that is rare, and it saves 32 multiplies a block
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
        #pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
            acc[mt][0] *= alpha[0]; acc[mt][1] *= alpha[1]; acc[mt][2] *= alpha[0]; acc[mt][3] *= alpha[1];
        }
    }
    // P^T as the B fragment: transpose the two 8x8 f16 halves of S^T (rows 0..7, rows 8..15)
    const u32 pb0 = transpose8x8(pack_f16x2(s[0], s[1]));
    const u32 pb1 = transpose8x8(pack_f16x2(s[2], s[3]));
    #pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
        u32 w0 = r.vw[mt][0], w1 = r.vw[mt][1];
        if (!FULL) {  // bytes of keys at or past seq_len are zeroed (an unwritten slot may hold NaN)
            const int valid = seq_len - (key0 + 4 * t);
            const u32 keep = valid >= 4 ? 0xffffffffu : (valid <= 0 ? 0u : (0xffffffffu >> (8 * (4 - valid))));
            w0 &= keep; w1 &= keep;
        }
        mma4(acc[mt], widen2(w0), widen2(w1), widen2_hi(w0), widen2_hi(w1), pb0, pb1);
    }
}

extern "C" __global__ void __launch_bounds__(128, 2) fp8_decode(
    const u16* __restrict__ Q,            // bf16 [1, Hq, B, D]
    const unsigned char* __restrict__ Cache,
    const int* __restrict__ BlockTables, const int* __restrict__ SeqLens,
    u16* __restrict__ Out,                // bf16 [1, Hq, B, D]
    float* __restrict__ PartAcc, float* __restrict__ PartMax, float* __restrict__ PartSum,  // split-KV partials
    float score_scale,                    // softmax scale * log2(e) * k_scale
    float v_scale, int num_seqs, int stride_bt, int stride_qh, long long stride_cb, int stride_ckv, int stride_ch,
    int num_heads)
{
    // grid (num_seqs, Hkv, segments): with more than one segment each CTA takes a range of blocks and writes its
    // partials [seq, head, segment] (m in log2 units, l, and v_scale-scaled sums) as attention.py's
    // _merge_segments_kernel reads them
    const int seq = blockIdx.x, kvh = blockIdx.y, seg = blockIdx.z, segments = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int seq_len = SeqLens[seq];
    const int* table = BlockTables + (long long)seq * stride_bt;
    const unsigned char* head = Cache + (long long)kvh * stride_ch;

    // q^T's B fragments: column n = g is query head g (< 4); k 2t..2t+1 <-> d 32t + 4ks + {0,1}, 2t+8.. <-> {2,3}
    u32 qb[8][2];
    {
        float qv[32];
        if (g < GROUP) {
            const u16* qrow = Q + (long long)(kvh * GROUP + g) * stride_qh + (long long)seq * D + 32 * t;
            #pragma unroll
            for (int i = 0; i < 32; i += 8) {
                uint4 w = *reinterpret_cast<const uint4*>(qrow + i);
                u32 ws[4] = {w.x, w.y, w.z, w.w};
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    qv[i + 2 * j] = bf16_to_f32(ws[j] & 0xffff);
                    qv[i + 2 * j + 1] = bf16_to_f32(ws[j] >> 16);
                }
            }
        } else {
            #pragma unroll
            for (int i = 0; i < 32; ++i) qv[i] = 0.f;
        }
        #pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) qv[4 * ks + j] = fminf(fmaxf(qv[4 * ks + j], -65504.f), 65504.f);
            qb[ks][0] = pack_f16x2(qv[4 * ks], qv[4 * ks + 1]);
            qb[ks][1] = pack_f16x2(qv[4 * ks + 2], qv[4 * ks + 3]);
        }
    }
    float acc[8][4];
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};

    // warp w takes blocks b_lo + w, b_lo + w + 4, ... of its segment; the last (partial) block is masked
    const int nblocks = (seq_len + BS - 1) / BS;
    const int per_seg = (nblocks + segments - 1) / segments;
    const int b_lo = seg * per_seg, b_hi = min(b_lo + per_seg, nblocks);
    const int full_end = min(seq_len / BS, b_hi);
    int b = b_lo + warp;
    auto load = [&](BlockRegs& r, int block) {  // the sequence's block-th block of this head
        const unsigned char* kb = head + (long long)table[block] * stride_cb;
        load_block(r, kb, kb + stride_ckv, g, t);
    };
    BlockRegs r0;
#if PIPE
    // two register sets: the next block's loads are in flight while this one is computed
    BlockRegs r1;
    if (b < full_end) load(r0, b);
    while (b < full_end) {
        const int b1 = b + WARPS;
        if (b1 < full_end) load(r1, b1);
        attend_block<true>(r0, b * BS, seq_len, score_scale, qb, acc, m, l, g, t);
        b = b1;
        if (b >= full_end) break;
        const int b2 = b + WARPS;
        if (b2 < full_end) load(r0, b2);
        attend_block<true>(r1, b * BS, seq_len, score_scale, qb, acc, m, l, g, t);
        b = b2;
    }
#else
    for (; b < full_end; b += WARPS) {
        load(r0, b);
        attend_block<true>(r0, b * BS, seq_len, score_scale, qb, acc, m, l, g, t);
    }
#endif
    if (b < b_hi) {
        load(r0, b);
        attend_block<false>(r0, b * BS, seq_len, score_scale, qb, acc, m, l, g, t);
    }

    // column c of lane (g, t) is query head 2t + c (t < 2); acc[mt] = (d 16mt + g: c0, c1), (d 16mt + g + 8: c2, c3)
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        l[c] += __shfl_xor_sync(0xffffffff, l[c], 4);
        l[c] += __shfl_xor_sync(0xffffffff, l[c], 8);
        l[c] += __shfl_xor_sync(0xffffffff, l[c], 16);
    }
    __shared__ float sm_m[WARPS][GROUP], sm_l[WARPS][GROUP];
    __shared__ float sm_acc[WARPS][GROUP][D];
    if (t < 2) {
        if (g == 0) {
            #pragma unroll
            for (int c = 0; c < 2; ++c) { sm_m[warp][2 * t + c] = m[c]; sm_l[warp][2 * t + c] = l[c]; }
        }
        #pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
            sm_acc[warp][2 * t][16 * mt + g] = acc[mt][0];
            sm_acc[warp][2 * t + 1][16 * mt + g] = acc[mt][1];
            sm_acc[warp][2 * t][16 * mt + g + 8] = acc[mt][2];
            sm_acc[warp][2 * t + 1][16 * mt + g + 8] = acc[mt][3];
        }
    }
    __syncthreads();
    const int r = threadIdx.x >> 5, d0 = 4 * (threadIdx.x & 31);
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
        const long long part = ((long long)seq * num_heads + kvh * GROUP + r) * segments + seg;
        if ((threadIdx.x & 31) == 0) { PartMax[part] = mm; PartSum[part] = den; }
        #pragma unroll
        for (int i = 0; i < 4; ++i) PartAcc[part * D + d0 + i] = o[i] * v_scale;
        return;
    }
    const float inv = den > 0.f ? v_scale / den : 0.f;
    u16* orow = Out + (long long)(kvh * GROUP + r) * stride_qh + (long long)seq * D + d0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) orow[i] = f32_to_bf16(o[i] * inv);
}
"""


def compile_cubin(arch: str = "sm_90a", pipe: int = 0) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(SRC.encode(), b"fp8_decode.cu", 0, [], [])
    options = [f"-arch={arch}".encode(), b"--std=c++17", b"--use_fast_math", f"-DPIPE={pipe}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(log.decode(errors="replace"))
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return cubin


def offline() -> None:
    """Each variant's registers and the SASS mix of its loops (> 50 instructions), compiled for sm_90a."""
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inspect_kernels import nvdisasm, sass_loops

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for pipe in (0, 1):
        cubin = compile_cubin(pipe=pipe)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            sass = nvdisasm(str(path))
            res = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True).stdout
        print(f"PIPE={pipe}: " + " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+", res)))
        for count, ops in sass_loops(sass):
            if count > 50:
                print(f"  loop of {count} instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))


# ---------------------------------------------------------------------------------------------------------------------
# --emulate: the kernel's fragment bookkeeping in numpy (lane by lane), against plain attention, on the CPU. It checks
# the d and key orders, the transposes and the softmax reductions as the kernel writes them, given PTX's documented
# m16n8k16 and movmatrix fragment layouts; it cannot check the PTX itself (the GPU run does).
# ---------------------------------------------------------------------------------------------------------------------
def _mma(c, a, b):
    """c[lane][4] += A @ B from the 32 lanes' fragments (m16n8k16: a[lane][8], b[lane][4], c[lane][4])."""
    import numpy as np

    A, Bm = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i, (r, k) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                                    (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]):
            A[r, k] = a[lane][i]
        for i, (k, n) in enumerate([(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]):
            Bm[k, n] = b[lane][i]
    C = A @ Bm
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i, (r, n) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            c[lane][i] += C[r, n]


def _movmatrix_trans(x):
    """x[lane] = (M[g][2t], M[g][2t + 1]) of an 8x8 matrix -> the same of M^T."""
    M = [[0.0] * 8 for _ in range(8)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        M[g][2 * t], M[g][2 * t + 1] = x[lane]
    return [(M[2 * (lane & 3)][lane >> 2], M[2 * (lane & 3) + 1][lane >> 2]) for lane in range(32)]


def emulate(seq_len: int = 100, warps: int = 4, seed: int = 0) -> float:
    """One sequence and KV head through the kernel's steps; returns max |emulated - reference| / max |reference|."""
    import numpy as np

    rng = np.random.default_rng(seed)
    D_, BS_, G = 128, 16, 4
    nblocks = -(-seq_len // BS_)
    q = rng.standard_normal((G, D_)).astype(np.float16).astype(np.float32)
    keys = rng.standard_normal((nblocks * BS_, D_)).astype(np.float16).astype(np.float32)  # as widened (exact)
    vals = rng.standard_normal((nblocks * BS_, D_)).astype(np.float16).astype(np.float32)
    scale = D_ ** -0.5 * 1.4426950408889634
    s = (q @ keys[:seq_len].T) * scale
    p = np.exp2(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ vals[:seq_len]

    # q^T's B fragments: b[ks][lane] = (q[g][32t+4ks], +1, +2, +3) for g < 4
    qb = [[(tuple(q[lane >> 2, 32 * (lane & 3) + 4 * ks + j] for j in range(4)) if lane >> 2 < G else (0.0,) * 4)
           for lane in range(32)] for ks in range(8)]
    kg = [4 * ((lane >> 2) >> 1) + ((lane >> 2) & 1) for lane in range(32)]  # S^T row g's key in the block
    ms, ls, accs = [], [], []
    for w in range(warps):
        acc = [[0.0] * 4 for _ in range(8 * 32)]  # acc[mt * 32 + lane]
        m, l = [[-1e30, -1e30] for _ in range(32)], [[0.0, 0.0] for _ in range(32)]
        for b in range(w, nblocks, warps):
            key0 = b * BS_
            sc = [[0.0] * 4 for _ in range(32)]
            for ks in range(8):
                a = []
                for lane in range(32):
                    t = lane & 3
                    d = 32 * t + 4 * ks
                    ka, kb_ = keys[key0 + kg[lane]], keys[key0 + kg[lane] + 2]
                    a.append((ka[d], ka[d + 1], kb_[d], kb_[d + 1], ka[d + 2], ka[d + 3], kb_[d + 2], kb_[d + 3]))
                _mma(sc, a, qb[ks])
            for lane in range(32):
                for i in range(4):
                    key = key0 + (kg[lane] if i < 2 else kg[lane] + 2)
                    sc[lane][i] = sc[lane][i] * scale if key < seq_len else -np.inf
            for c in range(2):  # per column: max over rows (lanes of the same t) and the thread's two rows
                for t in range(4):
                    lanes = [g * 4 + t for g in range(8)]
                    mx = max(max(sc[x][c], sc[x][c + 2]) for x in lanes)
                    for x in lanes:
                        new = max(m[x][c], mx)
                        alpha = 2.0 ** (m[x][c] - new)
                        m[x][c] = new
                        sc[x][c], sc[x][c + 2] = 2.0 ** (sc[x][c] - new), 2.0 ** (sc[x][c + 2] - new)
                        l[x][c] = l[x][c] * alpha + sc[x][c] + sc[x][c + 2]
                        for mt in range(8):
                            acc[mt * 32 + x][c] *= alpha
                            acc[mt * 32 + x][c + 2] *= alpha
            f16 = lambda x: float(np.float16(x))  # noqa: E731 - the f16 pack of P
            pb0 = _movmatrix_trans([(f16(sc[x][0]), f16(sc[x][1])) for x in range(32)])
            pb1 = _movmatrix_trans([(f16(sc[x][2]), f16(sc[x][3])) for x in range(32)])
            pb = [pb0[x] + pb1[x] for x in range(32)]
            for mt in range(8):
                a = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    kk = [key0 + 4 * t + j for j in range(4)]
                    v0 = [vals[k, 16 * mt + g] if k < seq_len else 0.0 for k in kk]
                    v1 = [vals[k, 16 * mt + g + 8] if k < seq_len else 0.0 for k in kk]
                    a.append((v0[0], v0[1], v1[0], v1[1], v0[2], v0[3], v1[2], v1[3]))
                sub = acc[mt * 32:(mt + 1) * 32]
                _mma(sub, a, pb)
        col_l = {}  # l summed over the lanes of a column
        for t in range(2):
            for c in range(2):
                col_l[2 * t + c] = sum(l[g * 4 + t][c] for g in range(8))
        ms.append({2 * t + c: m[t][c] for t in range(2) for c in range(2)})
        ls.append(col_l)
        out = np.zeros((G, D_))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if t < 2:
                for mt in range(8):
                    out[2 * t, 16 * mt + g], out[2 * t + 1, 16 * mt + g] = acc[mt * 32 + lane][0:2]
                    out[2 * t, 16 * mt + g + 8], out[2 * t + 1, 16 * mt + g + 8] = acc[mt * 32 + lane][2:4]
        accs.append(out)
    got = np.zeros((G, D_))
    for r in range(G):
        mm = max(x[r] for x in ms)
        f = [2.0 ** (x[r] - mm) for x in ms]
        den = sum(fi * li[r] for fi, li in zip(f, ls))
        got[r] = sum(fi * a[r] for fi, a in zip(f, accs)) / den
    return float(np.abs(got - want).max() / np.abs(want).max())


# (B, Hq, Hkv, L, D, segments of the CUDA kernel): issue 33's three shapes, and a partial last block
SHAPES = ((64, 32, 8, 4096, 128, 1), (16, 32, 8, 8192, 128, 1), (16, 32, 8, 8192, 128, 2),
          (1, 32, 8, 32768, 128, 32), (1, 32, 8, 32768, 128, 64), (3, 32, 8, 1000, 128, 1), (3, 32, 8, 1000, 128, 3))


def on_gpu(out_path: str | None) -> None:
    import functools

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the GPU run needs a CUDA GPU; here use --emulate (CPU) or --offline (compile only)")
    from cuda.bindings import driver

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import amax_scales, bench_graph_ms, make_paged_decode, reference_rel_err

    from trtopt.plugins.paged_attention.attention import _merge_segments_kernel
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton
    from trtopt.plugins.paged_attention.reference import quantized_pool

    torch.cuda.init()
    kernels = {}
    for pipe in (0, 1):  # PIPE=1: the next block's loads in flight while this one computes (152 registers)
        err, module = driver.cuModuleLoadData(compile_cubin(pipe=pipe))
        assert err == driver.CUresult.CUDA_SUCCESS, err
        err, kernels[pipe] = driver.cuModuleGetFunction(module, b"fp8_decode")
        assert err == driver.CUresult.CUDA_SUCCESS, err
    rows, made = [], {}
    for (B, Hq, Hkv, L, D, segments), pipe in itertools.product(SHAPES, (0, 1)):
        fn = kernels[pipe]
        if (B, L) not in made:
            made.clear()
            step = make_paged_decode(B, Hq, Hkv, L, D, torch.bfloat16, device="cuda")
            step["slot_mapping"] = torch.full_like(step["slot_mapping"], -1)  # the probe writes nothing
            k_scale, v_scale = amax_scales(step["kv_cache"])
            fp8 = {**step, "kv_cache": quantized_pool(step["kv_cache"], k_scale, v_scale)}
            made[(B, L)] = step, fp8, k_scale, v_scale
        step, fp8, k_scale, v_scale = made[(B, L)]
        attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
        pool = fp8["kv_cache"].view(torch.uint8)
        q = fp8["q"]
        out = torch.empty_like(q)
        part_acc = torch.empty(B * Hq * segments * D, dtype=torch.float32, device="cuda")
        part_max = torch.empty(B * Hq * segments, dtype=torch.float32, device="cuda")
        part_sum = torch.empty_like(part_max)
        tables, lens = fp8["block_tables"], fp8["seq_lens"]
        scalars = [ctypes.c_float(D**-0.5 * 1.4426950408889634 * k_scale), ctypes.c_float(v_scale),
                   ctypes.c_int(B), ctypes.c_int(tables.stride(0)), ctypes.c_int(q.stride(1)),
                   ctypes.c_longlong(pool.stride(0)), ctypes.c_int(pool.stride(1)), ctypes.c_int(pool.stride(2)),
                   ctypes.c_int(Hq)]
        ptrs = [ctypes.c_uint64(x.data_ptr()) for x in (q, pool, tables, lens, out, part_acc, part_max, part_sum)]
        values = ptrs + scalars
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

        def cuda_call(fn=fn, params=params, B=B, Hkv=Hkv, Hq=Hq, segments=segments, out=out,
                      parts=(part_acc, part_max, part_sum)):
            (e,) = driver.cuLaunchKernel(fn, B, Hkv, segments, 128, 1, 1, 0,
                                         torch.cuda.current_stream().cuda_stream, ctypes.addressof(params), 0)
            assert e == driver.CUresult.CUDA_SUCCESS, e
            if segments > 1:
                _merge_segments_kernel[(B, Hq)](*parts, out, Hq, out.stride(1), out.stride(2), out.stride(3),
                                                NUM_SEGMENTS=segments, HEAD_DIM=D, BLOCK_D=D)
            return out, None

        cuda_call()
        torch.cuda.synchronize()
        row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·L{L}·D{D}", "cuda_segments": segments, "pipe": pipe,
               "cuda_rel_err": reference_rel_err(out, fp8, attrs, k_scale=k_scale, v_scale=v_scale)}
        triton_call = functools.partial(paged_attention_triton, **fp8, **attrs, k_scale=k_scale, v_scale=v_scale,
                                        state=PagedLaunchState())
        got, _ = triton_call()
        row["triton_rel_err"] = reference_rel_err(got, fp8, attrs, k_scale=k_scale, v_scale=v_scale)
        row["cuda_vs_triton"] = float((out.float() - got.float()).abs().max() / got.float().abs().max())
        if row["cuda_rel_err"] < 0.01:
            bf16_call = functools.partial(paged_attention_triton, **step, **attrs, state=PagedLaunchState())
            row.update(cuda_us=bench_graph_ms(cuda_call) * 1e3, triton_fp8_us=bench_graph_ms(triton_call) * 1e3,
                       triton_bf16_us=bench_graph_ms(bf16_call) * 1e3)
            row["cuda_speedup_vs_bf16"] = row["triton_bf16_us"] / row["cuda_us"]
            row["triton_fp8_speedup_vs_bf16"] = row["triton_bf16_us"] / row["triton_fp8_us"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    if out_path:
        Path(out_path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="compile for sm_90a and print the SASS mix (no GPU)")
    mode.add_argument("--emulate", action="store_true", help="the fragment bookkeeping in numpy (CPU)")
    ap.add_argument("--out", type=Path, help="GPU run: where to write the JSON results")
    args = ap.parse_args()
    if args.offline:
        offline()
    elif args.emulate:
        for n in (100, 16, 7, 64):
            print(f"seq_len {n}: emulated kernel vs plain attention, max error / max = {emulate(n):.2e}")
    else:
        on_gpu(str(args.out) if args.out else None)


if __name__ == "__main__":
    main()
