"""Projection layout at small M on the GPU: x @ W (the plan's [K, N]) vs F.linear(x, Wᵀ) ([N, K], nn.Linear's
layout) vs a plain Triton GEMV, for the 1.24B Llama-shaped plan's projections and SmolLM2-135M's (issue 11); and for
gate/up, the projection + trtopt.SiluMul (two launches) vs a GEMV with SiLU·mul as its epilogue (one launch).

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
# Triton's autotuner: short timing windows (ms) per config, so that tuning every shape and M fits in one GPU call.
TUNE = {"warmup": 5, "rep": 20}
TRITON_MAX_M = 4  # the Triton GEMVs are timed for M <= this (the decode rows they are meant for)
TINY = [("tiny_qkv", 64, 96), ("tiny_down", 128, 64), ("tiny_gate_up", 64, 160)]


def gemv_kernel(autotune: bool = True):
    """runtime/gemv_kernel.py's GEMV over [N, K] weights, autotuned per (M, N, K) at its first call (outside the
    timed graphs) over a grid of tiles; autotune=False: one fixed small config (the interpreter smoke run). The
    chosen config of each shape is recorded (`best_configs`) to set gemv_kernel.GEMV_CONFIG from."""
    return _tuned("_gemv", ["M", "N", "K"], autotune, [(bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512)
                                                        for w in (4, 8)])


def gemv_silu_mul_kernel(autotune: bool = True):
    """runtime/gemv_kernel.py's gate/up GEMV with SiLU·mul as its epilogue (one launch), tuned the same way."""
    return _tuned("_gemv_silu_mul", ["M", "I", "K"], autotune, [(bn, bk, w) for bn in (4, 8) for bk in (256, 512)
                                                                 for w in (4, 8)])


BEST_CONFIGS: dict[str, str] = {}  # "kernel M N K" -> the autotuner's choice


def _tuned(name: str, key: list[str], autotune: bool, grid: list[tuple[int, int, int]]):
    import triton

    from trtopt.plugins.kernel_common import TL_DTYPES
    from trtopt.runtime import gemv_kernel

    jit = getattr(gemv_kernel, name)
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=3) for bn, bk, w in grid]
    kernel = triton.autotune(configs=configs, key=key, **TUNE)(jit) if autotune else jit
    fixed = {} if autotune else {"BLOCK_N": 8, "BLOCK_K": 32}
    fused = name == "_gemv_silu_mul"

    def run(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        N = wt.shape[0] // 2 if fused else wt.shape[0]
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        extra = {"DTYPE": TL_DTYPES[x.dtype]} if fused else {}
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, wt, y, M, N, K, x.stride(0), wt.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(M),
            **extra, **fixed)
        if autotune:
            BEST_CONFIGS[f"{name} M={M} N={N} K={K}"] = str(kernel.best_config)
        return y

    return run


def silu_mul_after(project):
    """The unfused pair as the step runs it: the projection (cuBLAS), then trtopt.SiluMul on its two halves."""
    from trtopt.plugins.silu_mul.reference import silu_mul_ref

    try:
        from trtopt.plugins.silu_mul.kernel import silu_mul_triton
    except ImportError:
        silu_mul_triton = None

    def run(x, w):
        gu = project(x, w)
        gate, up = gu.split(gu.shape[-1] // 2, dim=-1)
        fn = silu_mul_triton if (silu_mul_triton is not None and x.is_cuda) else silu_mul_ref
        return fn(gate, up)

    return run


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


def measure(row: dict, variants: dict, xs, want: torch.Tensor, device: torch.device, iters: int,
            max_err: float) -> None:
    """Check each variant (fn, weight copies) against `want` (fp32), then time it: row[variant] = µs per call, the
    weight's TB/s and the error; row["fastest"] names the quickest. A wrong variant ends the run."""
    for vname, (fn, weights) in variants.items():
        got = fn(xs[0], weights[0]).float()
        err = float((got - want).abs().max() / want.abs().max())
        if err > max_err:
            raise SystemExit(f"{vname} on {row['shape']} M={row['M']} is wrong: max relative error {err:.2e}")
        seconds = time_variant(fn, xs, weights, device, iters)
        row[vname] = {"us": seconds * 1e6, "weight_TBps": row["weight_bytes"] / seconds / 1e12, "max_rel_err": err}
    row["fastest"] = min(variants, key=lambda v: row[v]["us"])


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
    fused_gemv = None if args.no_triton else gemv_silu_mul_kernel(autotune=device.type == "cuda")
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
            if gemv is not None and M <= TRITON_MAX_M:
                variants["triton_gemv_NK"] = (gemv, wts)
            row = {"shape": name, "K": K, "N": N, "M": M, "weight_bytes": nbytes, "copies": copies}
            measure(row, variants, xs, want, device, args.iters, 2e-2 if dtype != torch.float32 else 1e-4)
            fastest = row["fastest"]
            data["rows"].append(row)
            print(f"{name:>16} M={M:<4} " + "  ".join(
                f"{v} {row[v]['us']:8.2f} us {row[v]['weight_TBps']:5.2f} TB/s" for v in variants) + f"  → {fastest}",
                flush=True)
        if name.endswith("gate_up"):
            fused_rows(data, name, K, N, ws, wts, args, device, dtype, gen, fused_gemv)
        del ws, wts, w0
    data["triton_best_configs"] = BEST_CONFIGS
    out = args.out or DOCS / f"projection_layout_{'tiny_' if args.tiny else ''}{gpu.split()[-1].lower()}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")
    plot(data, out.with_suffix(".png"))


def fused_rows(data, name, K, N, ws, wts, args, device, dtype, gen, fused_gemv) -> None:
    """gate/up then SiLU·mul: cuBLAS in either layout + the SiluMul kernel (two launches) vs the fused GEMV (one)."""
    from trtopt.plugins.silu_mul.reference import silu_mul_ref

    for M in [m for m in args.ms if m <= TRITON_MAX_M]:
        xs = [torch.randn(M, K, generator=gen).to(device, dtype) for _ in range(2)]
        gu = (xs[0].float() @ ws[0].float()).to(dtype)
        want = silu_mul_ref(*gu.split(N // 2, dim=-1)).float()
        variants = {"matmul_KN+silu_mul": (silu_mul_after(lambda x, w: torch.matmul(x, w)), ws),
                    "linear_NK+silu_mul": (silu_mul_after(lambda x, w: F.linear(x, w)), wts)}
        if fused_gemv is not None:
            variants["triton_gemv_silu_mul_NK"] = (fused_gemv, wts)
        row = {"shape": f"{name}+silu_mul", "K": K, "N": N, "M": M, "weight_bytes": ws[0].numel() * ws[0].element_size(),
               "copies": len(ws)}
        measure(row, variants, xs, want, device, args.iters, 5e-2 if dtype != torch.float32 else 1e-4)
        data["rows"].append(row)
        print(f"{name + '+silu':>16} M={M:<4} " + "  ".join(
            f"{v} {row[v]['us']:8.2f} us" for v in variants) + f"  → {row['fastest']}", flush=True)


VARIANT_COLORS = {"matmul_KN": "tab:blue", "linear_NK": "tab:orange", "triton_gemv_NK": "tab:green",
                  "matmul_KN+silu_mul": "tab:cyan", "linear_NK+silu_mul": "tab:red", "triton_gemv_silu_mul_NK": "tab:olive"}


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
        for v, color in VARIANT_COLORS.items():
            pts = [(r["M"], r[v]["weight_TBps"]) for r in rows if v in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=v)
        if data.get("copy_bandwidth_Bps"):
            ax.axhline(data["copy_bandwidth_Bps"] / 1e12, color="gray", ls="--", lw=1, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} ({rows[0]['K']}×{rows[0]['N']})", fontsize=9)
        ax.set_xlabel("M (rows)")
    axes[0][0].set_ylabel("weight TB/s")
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=len(handles))
    fig.subplots_adjust(bottom=0.3)
    fig.suptitle(f"projection layout at small M, {data['machine']['gpu']}, {data['dtype']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
