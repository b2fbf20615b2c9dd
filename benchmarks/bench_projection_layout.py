"""Projection layout at small M on the GPU: x @ W (the plan's [K, N]) vs F.linear(x, Wᵀ) ([N, K], nn.Linear's
layout) vs a plain Triton GEMV, for the 1.24B Llama-shaped plan's projections and SmolLM2-135M's (issue 11).

Why: the batch-1 profile on the H200 (docs/benchmarks/GPU_E2E.md) has cuBLAS streaming the tied LM head, already
[N, K], at 4.3 TB/s while the [K, N] Q/K/V and O projections reach ~1.9 TB/s at M = 1. `TorchExecutor(
linear_weights=True)` switches the executor to [N, K]; this script says per shape and M which layout (or a GEMV
kernel) is faster before that becomes a default.

Method: each variant runs inside one CUDA graph of `reps` calls that cycle through enough copies of the weight to
exceed the L2 cache (so every call streams its weight from HBM, as a decode step does), replayed `--iters` times
between CUDA events; µs per call and the weight's TB/s are reported, with the device's copy bandwidth measured in
the same run as the ceiling. Every variant's output is checked against x @ W in fp32 first.

    python3 benchmarks/bench_projection_layout.py                       # → docs/benchmarks/projection_layout_<gpu>.json + .png
    TRITON_INTERPRET=1 python3 benchmarks/bench_projection_layout.py --device cpu --tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"

# (name, K, N): the projections of one decode step.
SHAPES_1B = [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048),
             ("lm_head", 2048, 128256)]
SHAPES_SMOLLM2 = [("smollm2_qkv", 576, 960), ("smollm2_o", 576, 576), ("smollm2_gate_up", 576, 3072),
                  ("smollm2_down", 1536, 576), ("smollm2_lm_head", 576, 49152)]
TINY = [("tiny_qkv", 64, 96), ("tiny_down", 128, 64)]


def gemv_kernel(autotune: bool = True):
    """A Triton GEMV over [N, K] weights (K contiguous): one program per BLOCK_N output columns, all M rows of x,
    fp32 accumulation; autotuned per (M, N, K) at the first call (outside the timed graphs). autotune=False: one
    fixed config (the interpreter check in the smoke run)."""
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
               for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for w in (2, 4, 8) for s in (2, 4)
               if bn * bk <= 8192]

    @triton.jit
    def _gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
              M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        n_ok = offs_n < N
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [M_PAD, BLOCK_K]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & n_ok[None, :])

    kernel = triton.autotune(configs=configs, key=["M", "N", "K"])(_gemv) if autotune else _gemv
    fixed = {} if autotune else {"BLOCK_N": 8, "BLOCK_K": 32}

    def gemv(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        N = wt.shape[0]
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, wt, y, M, N, K, x.stride(0), wt.stride(0), y.stride(0), M_PAD=max(1, triton.next_power_of_2(M)),
            **fixed)
        return y

    return gemv


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)  # read + write


def time_variant(fn, xs, ws, device: torch.device, iters: int) -> float:
    """Seconds per call: one CUDA graph cycling the weight copies, replayed `iters` times (CPU: a plain loop)."""
    reps = len(ws)
    if device.type != "cuda":
        fn(xs[0], ws[0])
        t = time.perf_counter()
        for i in range(iters * reps):
            fn(xs[i % len(xs)], ws[i % reps])
        return (time.perf_counter() - t) / (iters * reps)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up (and Triton's autotuning) outside the capture
            fn(xs[i % len(xs)], ws[i % reps])
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(xs[i % len(xs)], ws[i])
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="two tiny shapes (a smoke run)")
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--l2-multiple", type=float, default=4.0,
                    help="weight copies per graph: enough to be this many times the L2 size (HBM-bound calls)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton GEMV rows")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else SHAPES_1B + SHAPES_SMOLLM2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1 << 20
    gemv = None if args.no_triton else gemv_kernel(autotune=device.type == "cuda")  # CPU: TRITON_INTERPRET=1
    data = {"benchmark": "projection_layout", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "machine": {"gpu": gpu, "torch": torch.__version__, "l2_bytes": l2},
        "dtype": str(dtype), "copy_bandwidth_Bps": copy_bandwidth(device), "rows": []}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, K, N in shapes:
        nbytes = K * N * torch.finfo(dtype).bits // 8
        copies = max(2, min(64, math.ceil(args.l2_multiple * l2 / nbytes)))
        w0 = (torch.randn(K, N, generator=gen) / math.sqrt(K)).to(device, dtype)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]  # [K, N]: the plan's layout
        wts = [w.t().contiguous() for w in ws]  # [N, K]
        for M in args.ms:
            xs = [torch.randn(M, K, generator=gen).to(device, dtype) for _ in range(2)]
            want = xs[0].float() @ w0.float()
            variants = {"matmul_KN": (lambda x, w: torch.matmul(x, w), ws),
                        "linear_NK": (lambda x, w: F.linear(x, w), wts)}
            if gemv is not None and M <= 16:
                variants["triton_gemv_NK"] = (gemv, wts)
            row = {"shape": name, "K": K, "N": N, "M": M, "weight_bytes": nbytes, "copies": copies}
            for vname, (fn, weights) in variants.items():
                got = fn(xs[0], weights[0]).float()
                err = float((got - want).abs().max() / want.abs().max())
                if err > (2e-2 if dtype != torch.float32 else 1e-4):
                    raise SystemExit(f"{vname} on {name} M={M} is wrong: max relative error {err:.2e}")
                seconds = time_variant(fn, xs, weights, device, args.iters)
                row[vname] = {"us": seconds * 1e6, "weight_TBps": nbytes / seconds / 1e12, "max_rel_err": err}
            fastest = min((v for v in variants), key=lambda v: row[v]["us"])
            row["fastest"] = fastest
            data["rows"].append(row)
            print(f"{name:>16} M={M:<4} " + "  ".join(
                f"{v} {row[v]['us']:8.2f} us {row[v]['weight_TBps']:5.2f} TB/s" for v in variants) + f"  → {fastest}",
                flush=True)
        del ws, wts, w0
    out = args.out or DOCS / f"projection_layout_{'tiny_' if args.tiny else ''}{gpu.split()[-1].lower()}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")
    plot(data, out.with_suffix(".png"))


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.2), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in data["rows"] if r["shape"] == shape]
        for v in ("matmul_KN", "linear_NK", "triton_gemv_NK"):
            pts = [(r["M"], r[v]["weight_TBps"]) for r in rows if v in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        if data.get("copy_bandwidth_Bps"):
            ax.axhline(data["copy_bandwidth_Bps"] / 1e12, color="gray", ls="--", lw=1, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} ({rows[0]['K']}×{rows[0]['N']})", fontsize=9)
        ax.set_xlabel("M (rows)")
    axes[0][0].set_ylabel("weight TB/s")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"projection layout at small M, {data['machine']['gpu']}, {data['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
