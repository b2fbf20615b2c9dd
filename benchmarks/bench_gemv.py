"""Decode projections on the GPU: cuBLAS (the plan's [K, N] weights through torch.matmul, what the executor runs
without GEMVs; and F.linear on [N, K]) against runtime/kernels/gemv_triton.py's Triton GEMV on [N, K], for the 1.24B
Llama-shaped plan's projections and SmolLM2-135M's, at M = 1, 2, 4 rows (issue 11: batch-1 decode vs the roofline).
For gate/up, the projection + trtopt.SiluMul (two launches) against the GEMV with SiLU·mul as its epilogue (one).

Each GEMV row sweeps a grid of (BLOCK_N, BLOCK_K, num_warps) around gemv_triton.default_config and reports both the
default's time and the best config's, so the default is checked against the grid in the same run.

Method (as session 8's projection-layout benchmark): each variant runs inside one CUDA graph of `copies` calls that
cycle through enough copies of the weight to be `--l2-multiple` times the L2 cache (so every call streams its weight
from HBM, as a decode step does), replayed `--iters` times between CUDA events; µs per call and the weight's TB/s,
with the device's copy bandwidth measured in the same run as the ceiling. Every variant's output is checked against
x @ W in fp32 first.

    python3 benchmarks/bench_gemv.py                        # → docs/benchmarks/gemv_<gpu>.json + .png
    TRITON_INTERPRET=1 python3 benchmarks/bench_gemv.py --device cpu --tiny   # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import datetime
import itertools
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
# Llama-3-8B's projections and their tensor-parallel shards at N = 2 (column-parallel Q/K/V and gate/up keep K and
# halve N; row-parallel O and down halve K): does a rank's GEMV keep the bandwidth of the whole one (`--shapes` picks
# them; not in the default set).
SHAPES_8B = [("8b_qkv", 4096, 6144), ("8b_o", 4096, 4096), ("8b_gate_up", 4096, 28672), ("8b_down", 14336, 4096)]
SHAPES_8B_TP2 = [("8b_tp2_qkv", 4096, 3072), ("8b_tp2_o", 2048, 4096), ("8b_tp2_gate_up", 4096, 14336),
                 ("8b_tp2_down", 7168, 4096)]
TINY = [("tiny_qkv", 64, 96), ("tiny_down", 128, 64), ("tiny_gate_up", 64, 160)]


def sweep_grid(m: int, k: int, tiny: bool) -> list[tuple[int, int, int]]:
    """Configs timed for one (M, K): whole-row tiles up to 8 rows, K tiles of 512 to 8192, 2-8 warps, with the
    product (M_PAD · BLOCK_N · BLOCK_K) at most 32K elements (beyond it the registers spill)."""
    from trtopt.plugins.kernel_common import next_pow2

    if tiny:
        return [(2, 32, 1), (4, 64, 2)]
    kp = next_pow2(k)
    grid = []
    for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096, 8192), (2, 4, 8)):
        if bk <= kp and next_pow2(m) * bn * bk <= 32768 and (m == 1 or w == 4):
            grid.append((bn, bk, w))
    return grid


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
        t = time.perf_counter()
        for i in range(reps):
            fn(xs[i % len(xs)], ws[i])
        return (time.perf_counter() - t) / reps
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(2):  # warm-up (and compiles) outside the capture
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


def timed(row: dict, name: str, fn, xs, ws, want, device, iters: int, max_err: float) -> float:
    got = fn(xs[0], ws[0]).float()
    err = float((got - want).abs().max() / want.abs().max())
    if err > max_err:
        raise SystemExit(f"{name} on {row['shape']} M={row['M']} is wrong: max relative error {err:.2e}")
    seconds = time_variant(fn, xs, ws, device, iters)
    row[name] = {"us": seconds * 1e6, "weight_TBps": row["weight_bytes"] / seconds / 1e12, "max_rel_err": err}
    return seconds


def gemv_rows(row: dict, name: str, kernel, xs, wts, want, device, iters, max_err, tiny: bool) -> None:
    """The GEMV at its default config (row[name]) and the best of the sweep (row[name + '_best'], with config)."""
    from trtopt.runtime.kernels import gemv_triton

    m, k = xs[0].shape
    timed(row, name, lambda x, w: kernel(x, w), xs, wts, want, device, iters, max_err)
    row[name]["config"] = list(gemv_triton.default_config(m, row["N_out"], k, silu_mul="silu" in name))
    best = None
    sweep = {}
    for config in sweep_grid(m, k, tiny):
        seconds = timed(row, "_probe", lambda x, w, c=config: kernel(x, w, c), xs, wts, want, device, iters, max_err)
        sweep["x".join(map(str, config))] = round(seconds * 1e6, 3)
        if best is None or seconds < best[0]:
            best = (seconds, config, row["_probe"])
    row.pop("_probe", None)
    if best is not None:
        row[name + "_best"] = {**best[2], "config": list(best[1])}
    row[name + "_sweep_us"] = sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="three tiny shapes, two configs (a smoke run)")
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--shapes", nargs="*", default=None, help="shape names to run (default: the 1.24B and SmolLM2 ones; also 8b_* and 8b_tp2_*)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--l2-multiple", type=float, default=4.0,
                    help="weight copies per graph: enough to be this many times the L2 size (HBM-bound calls)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from trtopt.plugins.silu_mul.reference import silu_mul_ref
    from trtopt.runtime.kernels import gemv_triton

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else SHAPES_1B + SHAPES_SMOLLM2
    if args.shapes:
        shapes = [s for s in shapes + SHAPES_8B + SHAPES_8B_TP2 if s[0] in args.shapes]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1 << 20
    data = {"benchmark": "gemv", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"gpu": gpu, "torch": torch.__version__, "l2_bytes": l2}, "dtype": str(dtype),
            "copy_bandwidth_Bps": copy_bandwidth(device), "rows": []}
    max_err = 2e-2 if dtype != torch.float32 else 1e-4
    gen = torch.Generator(device="cpu").manual_seed(0)
    silu_mul = None
    if device.type == "cuda":
        from trtopt.plugins.silu_mul.kernel import silu_mul_triton as silu_mul
    for name, K, N in shapes:
        nbytes = K * N * torch.finfo(dtype).bits // 8
        copies = 2 if args.tiny else max(2, min(64, math.ceil(args.l2_multiple * l2 / nbytes)))
        w0 = (torch.randn(K, N, generator=gen) / math.sqrt(K)).to(device, dtype)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]  # [K, N]: the plan's layout
        wts = [w.t().contiguous() for w in ws]  # [N, K]
        for M in args.ms:
            xs = [torch.randn(M, K, generator=gen).to(device, dtype) for _ in range(2)]
            row = {"shape": name, "K": K, "N": N, "N_out": N, "M": M, "weight_bytes": nbytes, "copies": copies}
            want = xs[0].float() @ w0.float()
            timed(row, "cublas_KN", lambda x, w: torch.matmul(x, w), xs, ws, want, device, args.iters, max_err)
            timed(row, "linear_NK", lambda x, w: F.linear(x, w), xs, wts, want, device, args.iters, max_err)
            gemv_rows(row, "gemv_NK", gemv_triton.gemv, xs, wts, want, device, args.iters, max_err, args.tiny)
            data["rows"].append(row)
            report(row)
            if name.endswith("gate_up"):
                fused = {"shape": name + "+silu_mul", "K": K, "N": N, "N_out": N // 2, "M": M,
                         "weight_bytes": nbytes, "copies": copies}
                gu = (xs[0].float() @ w0.float()).to(dtype)
                want = silu_mul_ref(*gu.split(N // 2, dim=-1)).float()

                def unfused(x, w):
                    g, u = torch.matmul(x, w).split(N // 2, dim=-1)
                    return (silu_mul or silu_mul_ref)(g, u)

                timed(fused, "cublas_KN+silu_mul", unfused, xs, ws, want, device, args.iters, 5e-2)
                gemv_rows(fused, "gemv_silu_mul_NK", gemv_triton.gemv_silu_mul, xs, wts, want, device, args.iters,
                          5e-2, args.tiny)
                data["rows"].append(fused)
                report(fused)
        del ws, wts, w0
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = args.out or DOCS / f"gemv_{'tiny_' if args.tiny else ''}{gpu.split()[-1].lower()}.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    plot(data, out.with_suffix(".png"))


def report(row: dict) -> None:
    cells = [f"{v} {row[v]['us']:7.2f} us {row[v]['weight_TBps']:4.2f} TB/s"
             + (f" {row[v]['config']}" if "config" in row[v] else "")
             for v in row if isinstance(row[v], dict) and "us" in row[v]]
    print(f"{row['shape']:>22} M={row['M']:<2} " + " | ".join(cells), flush=True)


VARIANT_COLORS = {"cublas_KN": "tab:blue", "linear_NK": "tab:orange", "gemv_NK": "tab:green",
                  "gemv_NK_best": "tab:olive", "cublas_KN+silu_mul": "tab:cyan", "gemv_silu_mul_NK": "tab:red",
                  "gemv_silu_mul_NK_best": "tab:pink"}


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    cols = min(6, len(shapes))
    nrows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.0 * cols, 2.9 * nrows), sharey=True, squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        rows = [r for r in data["rows"] if r["shape"] == shape]
        for v, color in VARIANT_COLORS.items():
            pts = [(r["M"], r[v]["weight_TBps"]) for r in rows if v in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=v)
        if data.get("copy_bandwidth_Bps"):
            ax.axhline(data["copy_bandwidth_Bps"] / 1e12, color="gray", ls="--", lw=1, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} ({rows[0]['K']}×{rows[0]['N']})", fontsize=8)
        ax.set_xlabel("M (rows)", fontsize=8)
    for ax in axes.flat[len(shapes):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("weight TB/s")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=4)
    fig.suptitle(f"decode projections: cuBLAS vs Triton GEMV, {data['machine']['gpu']}, {data['dtype']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
