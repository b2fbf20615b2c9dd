"""The FP8 paged decode kernel in CUDA (trtopt/plugins/paged_attention/decode_cuda.py): its launch sweep on a GPU,
its compile offline, and a CPU emulation of its fragment bookkeeping.

    python benchmarks/fp8_cuda_decode.py --out docs/benchmarks/fp8_cuda_decode_sweep_h200.json  # GPU
    python benchmarks/fp8_cuda_decode.py --offline   # no GPU: compile for sm_90a; registers and the loops' SASS mix
    python benchmarks/fp8_cuda_decode.py --emulate   # CPU: the fragment bookkeeping in numpy vs plain attention

The GPU sweep times, per decode shape, the kernel under every segment count that keeps >= 128 keys a segment,
each with its next blocks' loads in flight in registers (PIPE) or in 2-4 cp.async stages or neither; graph
replays, with the Triton kernel over the same FP8 pool and over the bf16 pool in the same run, each checked against
the fp32 reference. It is what `plan_cuda_decode` was chosen from; the planned cell is marked.
--offline needs NVRTC (pip install cuda-bindings nvidia-cuda-nvrtc) and Triton's bundled nvdisasm.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = ((128, 4, True, False, 0), (128, 4, True, True, 0), (128, 4, True, False, 3), (64, 3, True, False, 3),
           (256, 4, True, False, 2))


def offline() -> None:
    """Registers and the SASS mix of the loops (> 50 instructions) of some configurations (head_dim, group, bf16 q,
    PIPE, cp.async stages), compiled for sm_90a."""
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inspect_kernels import nvdisasm, sass_loops

    from trtopt.plugins.paged_attention.decode_cuda import compile_cubin

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for config in CONFIGS:
        cubin = compile_cubin("sm_90a", *config)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            sass = nvdisasm(str(path))
            res = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True).stdout
        print(f"head_dim, group, bf16, PIPE, stages = {config}: "
              + " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+", res)))
        for count, ops in sass_loops(sass):
            if count > 50:
                print(f"  loop of {count} instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))


# ---------------------------------------------------------------------------------------------------------------------
# --emulate: the kernel's fragment bookkeeping in numpy (lane by lane; head_dim 128, group 4, one segment), against
# plain attention, on the CPU. It checks the d and key orders, the transposes and the softmax reductions as the kernel
# writes them, given PTX's documented m16n8k16 and movmatrix fragment layouts; the GPU tests check the CUDA itself
# (tests/plugins/test_paged_attention_cuda_decode.py).
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


# (B, Hq, Hkv, L, D): issue 33's three shapes, a partial last block, a large batch, and the models' shapes
# (Llama-3.2-1B's head_dim 64 as gpu_e2e.py runs it, SmolLM2-135M's group 3, Gemma-3-270m's head_dim 256)
SHAPES = ((64, 32, 8, 4096, 128), (16, 32, 8, 8192, 128), (1, 32, 8, 32768, 128), (3, 32, 8, 1000, 128),
          (256, 32, 8, 1024, 128), (1, 32, 8, 8192, 64), (32, 9, 3, 2048, 64), (1, 4, 1, 8192, 256))


def on_gpu(out_path: str | None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the GPU run needs a CUDA GPU; here use --emulate (CPU) or --offline (compile only)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import amax_scales, bench_graph_ms, make_paged_decode, reference_rel_err

    from trtopt.plugins.paged_attention import decode_cuda
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton
    from trtopt.plugins.paged_attention.planning import _device_sm_count
    from trtopt.plugins.paged_attention.reference import quantized_pool

    sms = _device_sm_count(torch.device("cuda"))
    rows = []
    for B, Hq, Hkv, L, D in SHAPES:
        step = make_paged_decode(B, Hq, Hkv, L, D, torch.bfloat16, device="cuda")
        step["slot_mapping"] = torch.full_like(step["slot_mapping"], -1)  # nothing written: every call reads alike
        k_scale, v_scale = amax_scales(step["kv_cache"])
        fp8 = {**step, "kv_cache": quantized_pool(step["kv_cache"], k_scale, v_scale)}
        attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
        planned = decode_cuda.plan_cuda_decode(B, Hkv, fp8["block_tables"].shape[1] * 16, sms, D)
        row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·L{L}·D{D}", "planned": planned.__dict__, "cells": []}
        for name, s, cuda in (("bf16", step, False), ("triton_fp8", fp8, False), ("planned_fp8", fp8, True)):
            scales = dict(k_scale=k_scale, v_scale=v_scale) if s is fp8 else {}
            call = functools.partial(paged_attention_triton, **s, **attrs, **scales,
                                     state=PagedLaunchState(cuda_decode=cuda))
            out, _ = call()
            row[name] = {"rel_err": reference_rel_err(out, s, attrs, **scales), "us": bench_graph_ms(call) * 1e3}
        segments = 1
        while segments <= 64 and L >= segments * 128:
            for pipe, stages in ((False, 0), (True, 0), (False, 2), (False, 3), (False, 4)):
                plan = decode_cuda.CudaDecodePlan(num_segments=segments, pipe=pipe, stages=stages)
                call = functools.partial(paged_attention_triton, **fp8, **attrs, k_scale=k_scale, v_scale=v_scale,
                                         launch=plan, state=PagedLaunchState())
                out, _ = call()
                cell = {"segments": segments, "pipe": pipe, "stages": stages, "planned": plan == planned,
                        "rel_err": reference_rel_err(out, fp8, attrs, k_scale=k_scale, v_scale=v_scale)}
                if cell["rel_err"] < 0.01:
                    cell["us"] = bench_graph_ms(call) * 1e3
                    cell["speedup_vs_bf16"] = row["bf16"]["us"] / cell["us"]
                row["cells"].append(cell)
            segments *= 2
        timed = [c for c in row["cells"] if "us" in c]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        for name in ("triton_fp8", "planned_fp8"):
            row[f"{name}_speedup_vs_bf16"] = row["bf16"]["us"] / row[name]["us"]
        print(json.dumps({k: v for k, v in row.items() if k != "cells"}), flush=True)
        rows.append(row)
        if out_path:  # rewritten after every shape, so a run cut short keeps what it measured
            Path(out_path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1)
                                      + "\n")
        del step, fp8
        torch.cuda.empty_cache()


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
