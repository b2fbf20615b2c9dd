"""QMatMul kernels against cuBLAS on the GPU: the 8B Llama's projections at M = 1, 16, 64, 256, 2048 rows (and 2, 4,
8 for the GEMV/GEMM crossover), in one run.

Variants per (projection, M), all on the same random weights (codes packed by plugins/qmatmul/packing.py, as a load
does; no download):
- bf16: F.linear on the bf16 [N, K] weight (cuBLAS, the executor's layout);
- scaled_mm: torch._scaled_mm alone on pre-quantized FP8 codes (cuBLASLt FP8, rowwise scales, bf16 out): the library;
- fp8_w8a8: kernel.py `qmatmul_packed` with a dynamic per-token activation scale (the dispatch: GEMV, Triton GEMM on
  the codes, or _scaled_mm from gemm.SCALED_MM_MIN_ROWS rows; the activation's quantization included);
- w8a8_triton: gemm.py `qgemm` on the codes with the row scale (the Triton W8A8 path, for SCALED_MM_MIN_ROWS);
- fp8_gemv / fp8_gemm: FP8 weight-only, the GEMV (M <= 16) and the Triton GEMM forced;
- int4_gemv / int4_gemm: INT4 g128 symmetric, the same two forced;
- fp8_dqmm / int4_dqmm (M >= 16): gemm.py `dequant_mm`, the weight dequantized to bf16 in one launch then cuBLAS
  (the dispatch's path from gemm.DEQUANT_MM_MIN_ROWS rows, weight-only), the dequantization timed with it.
`dispatch` names, per format, the path qmatmul_packed takes at that M and its time; `crossover` the smallest M from
which the GEMM beats the GEMV (what kernel.GEMV_MAX_ROWS should follow) and from which _scaled_mm's dispatch beats
the Triton W8A8 GEMM (gemm.SCALED_MM_MIN_ROWS).

Method: each variant runs inside one CUDA graph of calls cycling through enough weight copies to be twice the L2
cache (every call streams its weight from HBM), replayed between CUDA events, the replay count chosen for ~30 ms;
µs per call, TFLOP/s (2·M·K·N) and GB/s of the bytes a call must move (weights with scales, x, y). Every variant's
output is checked against the reference (x, or its FP8 Q/DQ, @ the dequantized weight in fp32) first.

    python benchmarks/bench_qmatmul.py           # → docs/benchmarks/qmatmul_<gpu-name-slug>.json + .png (< 3 min)
    python benchmarks/bench_qmatmul.py --smoke   # tiny shapes on the CPU under TRITON_INTERPRET=1 (seconds)

`--int4-gemv` times only the INT4 GEMV's variants against bf16 (kernel.py INT4_GEMV_VARIANTS: the fp32 kernel and
kernel_half2.py's packed half2 one, each at its default config, and the half2 one at the INT4_CONFIGS alternatives)
at M = 1, 2 on the same shapes, same method and checks, → docs/benchmarks/qmatmul_int4_gemv_<gpu>.json (< 1 min;
with --smoke, tiny shapes under the interpreter). Its `best` per (shape, M) names the fastest variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
# The 1.24B benchmark plan's projections (gpu_e2e.py's shape), named with --shapes: not in the default run
SHAPES_1B = [("qkv_1b", 2048, 3072), ("o_1b", 2048, 2048), ("gate_up_1b", 2048, 16384), ("down_1b", 8192, 2048)]
SMOKE_SHAPES = [("tiny_qkv", 64, 96), ("tiny_down", 128, 48)]
TABLE_M = [1, 16, 64, 128, 256, 2048]
CROSSOVER_M = [2, 4, 8]
SMOKE_M = [1, 2, 17]
GROUP = 128
SMOKE_GROUP = 32
L2_MULTIPLE = 2
MAX_REL_ERR = 2e-2
INT4_GEMV_M = [1, 2]
# (BLOCK_N, K values per tile, num_warps) the half2 GEMV is also timed at (kernel_half2.default_config_half2 is
# (8, 1024, 2) at one row): the first default, 4 warps, and 4 columns at one warp (probe_qgemv.py's sweep's next best).
INT4_CONFIGS = [(8, 2048, 2), (8, 4096, 4), (4, 1024, 1)]
SMOKE_INT4_CONFIGS = [(4, 64, 2)]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def time_calls(fn, n_weights: int, device: torch.device, target_s: float = 0.03) -> float:
    """Seconds per fn(i) over weight copies i: one CUDA graph of all copies, replayed for ~target_s (CPU: one
    pass, the interpreter)."""
    if device.type != "cuda":
        t = time.perf_counter()
        for i in range(n_weights):
            fn(i)
        return (time.perf_counter() - t) / n_weights
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(min(2, n_weights)):  # compiles and warm-up outside the capture
            fn(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_weights):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    iters = max(3, min(200, int(target_s / max(start.elapsed_time(end) / 1e3, 1e-6))))
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    del graph
    return start.elapsed_time(end) / 1e3 / (iters * n_weights)


def copies_for(nbytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(16, math.ceil(L2_MULTIPLE * l2 / nbytes)))


def clone_packed(w):
    return dataclasses.replace(w, data=w.data.clone(), scale=w.scale.clone(),
                               zero=None if w.zero is None else w.zero.clone())


def make_weights(k: int, n: int, group: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """{fmt: [copies]}: bf16 [N, K], FP8 and INT4 PackedQWeights (random codes in the plan's [K, N] layout)."""
    from trtopt.plugins.qmatmul.packing import pack_weight

    bf16 = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(dtype)
    codes = (torch.randn(k, n, device=device, generator=gen) * 64).to(torch.float8_e4m3fn)
    scale = (torch.rand(n, device=device, generator=gen) * 1e-3 + 1e-4).to(dtype)
    fp8 = pack_weight(codes, scale, torch.zeros(n, device=device).to(torch.float8_e4m3fn), block_size=0)
    del codes
    q = torch.randint(-8, 8, (k, n), device=device, generator=gen, dtype=torch.int8)
    s4 = ((torch.rand(k // group, n, device=device, generator=gen) + 0.5) / (8 * math.sqrt(k))).to(dtype)
    int4 = pack_weight(q, s4, torch.zeros(k // group, n, device=device, dtype=torch.int8), block_size=group)
    del q
    out = {}
    for fmt, w, nbytes in (("bf16", bf16, bf16.numel() * bf16.element_size()), ("fp8", fp8, fp8.nbytes),
                           ("int4", int4, int4.nbytes)):
        reps = copies_for(nbytes, device)
        out[fmt] = [w] + [w.clone() if fmt == "bf16" else clone_packed(w) for _ in range(reps - 1)]
    return out


def run_shape(name: str, k: int, n: int, ms: list[int], device, dtype, gen, deadline: float) -> dict:
    from trtopt.plugins.qmatmul.gemm import (DEQUANT_MM_MIN_ROWS, dequant_mm, fp8_scaled_mm, qgemm, quantize_fp8_rows,
                                             scaled_mm_supported)
    from trtopt.plugins.qmatmul.kernel import MAX_ROWS, gemv_max_rows, qgemv, qmatmul_packed
    from trtopt.plugins.qmatmul.packing import dequantize_packed
    from trtopt.plugins.qmatmul.reference import fake_quantize_fp8
    from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC

    group = GROUP if k % GROUP == 0 and device.type == "cuda" else SMOKE_GROUP
    ws = make_weights(k, n, group, device, dtype, gen)
    deq = {fmt: dequantize_packed(ws[fmt][0]) for fmt in ("fp8", "int4")}  # fp32 [K, N] references
    bytes_w = {"bf16": ws["bf16"][0].numel() * ws["bf16"][0].element_size(), "fp8": ws["fp8"][0].nbytes,
               "int4": ws["int4"][0].nbytes}
    rows = {}
    for m in ms:
        if time.monotonic() > deadline:
            rows["stopped"] = "time budget"
            break
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        act_scale = (x.float().abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
        codes, row_scale = quantize_fp8_rows(x, act_scale)
        x_dq = fake_quantize_fp8(x.float(), act_scale)
        want = {"plain_fp8": x.float() @ deq["fp8"], "w8a8": x_dq @ deq["fp8"], "int4": x.float() @ deq["int4"]}
        variants = {
            "bf16": ("bf16", None, lambda i: F.linear(x, ws["bf16"][i])),
            "fp8_gemm": ("fp8", "plain_fp8", lambda i: qgemm(x, ws["fp8"][i])),
            "int4_gemm": ("int4", "int4", lambda i: qgemm(x, ws["int4"][i])),
            "fp8_w8a8": ("fp8", "w8a8", lambda i: qmatmul_packed(x, ws["fp8"][i], act_scale, act_mode=ACT_DYNAMIC)),
        }
        if m >= 16 and dtype != torch.float32:
            variants["fp8_dqmm"] = ("fp8", "plain_fp8", lambda i: dequant_mm(x, ws["fp8"][i]))
            variants["int4_dqmm"] = ("int4", "int4", lambda i: dequant_mm(x, ws["int4"][i]))
        if m <= MAX_ROWS:
            variants["fp8_gemv"] = ("fp8", "plain_fp8", lambda i: qgemv(x, ws["fp8"][i]))
            variants["int4_gemv"] = ("int4", "int4", lambda i: qgemv(x, ws["int4"][i]))
        if m > 1:
            variants["w8a8_triton"] = ("fp8", "w8a8", lambda i: qgemm(codes, ws["fp8"][i], row_scale=row_scale.view(m),
                                                                        out_dtype=dtype))
        if device.type != "cuda" or scaled_mm_supported(x, ws["fp8"][0]):
            variants["scaled_mm"] = ("fp8", "w8a8", lambda i: fp8_scaled_mm(codes, ws["fp8"][i], row_scale))
        row = {}
        for vname, (fmt, ref, fn) in variants.items():
            got = fn(0).float()
            target = x.float() @ ws["bf16"][0].float().t() if ref is None else want[ref]
            err = float((got - target).abs().max() / target.abs().max().clamp_min(1e-30))
            if err > MAX_REL_ERR:
                raise SystemExit(f"{vname} on {name} M={m} is wrong: max relative error {err:.2e}")
            seconds = time_calls(fn, len(ws[fmt]), device)
            moved = bytes_w[fmt] + m * k * x.element_size() + m * n * x.element_size()
            row[vname] = {"us": round(seconds * 1e6, 3), "TFLOPs": round(2 * m * k * n / seconds / 1e12, 2),
                          "GBps": round(moved / seconds / 1e9, 1), "max_rel_err": float(f"{err:.2e}")}
        for vname, r in row.items():
            r["speedup_vs_bf16"] = round(row["bf16"]["us"] / r["us"], 3)
        def path(fmt: str) -> str:  # what qmatmul_packed runs at these rows (x in the benchmark's dtype)
            gemv_rows = gemv_max_rows(ws[fmt][0], x.dtype)
            return "gemv" if m <= gemv_rows else "dqmm" if m >= DEQUANT_MM_MIN_ROWS else "gemm"
        row["dispatch"] = {"fp8_weight_only": f"fp8_{path('fp8')}", "int4": f"int4_{path('int4')}",
                           "fp8_w8a8": "fp8_w8a8"}
        rows[str(m)] = row
        print(f"{name:8s} M={m:<5d} " + " ".join(f"{v}={r['us']:.1f}us({r['speedup_vs_bf16']:.2f}x)"
                                                 for v, r in row.items() if isinstance(r, dict) and "us" in r),
              flush=True)
    del ws, deq
    return {"K": k, "N": n, "int4_group": group, "weight_bytes": bytes_w, "M": rows}


def run_int4_gemv(name: str, k: int, n: int, ms: list[int], configs: list, device, dtype, gen) -> dict:
    """bf16 F.linear and every INT4 GEMV variant (and the half2 one at `configs`) at each M: µs, GB/s, speedup."""
    from trtopt.plugins.qmatmul.kernel import INT4_GEMV_VARIANTS, qgemv
    from trtopt.plugins.qmatmul.kernel_half2 import default_config_half2
    from trtopt.plugins.qmatmul.packing import dequantize_packed

    group = GROUP if k % GROUP == 0 and device.type == "cuda" else SMOKE_GROUP
    ws = make_weights(k, n, group, device, dtype, gen)
    del ws["fp8"]
    deq = dequantize_packed(ws["int4"][0])
    bytes_w = {"bf16": ws["bf16"][0].numel() * ws["bf16"][0].element_size(), "int4": ws["int4"][0].nbytes}
    rows = {}
    for m in ms:
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        want = x.float() @ deq
        variants = {"bf16": ("bf16", lambda i: F.linear(x, ws["bf16"][i]))}
        for v in INT4_GEMV_VARIANTS:
            variants[f"int4_gemv_{v}"] = ("int4", lambda i, v=v: qgemv(x, ws["int4"][i], variant=v))
        default = default_config_half2(m, n, k, group)
        for cfg in configs:
            if cfg != default and cfg[1] % group == 0:
                variants["int4_gemv_half2_" + "_".join(map(str, cfg))] = (
                    "int4", lambda i, cfg=cfg: qgemv(x, ws["int4"][i], cfg, variant="half2"))
        row = {}
        for vname, (fmt, fn) in variants.items():
            got = fn(0).float()
            target = x.float() @ ws["bf16"][0].float().t() if fmt == "bf16" else want
            err = float((got - target).abs().max() / target.abs().max().clamp_min(1e-30))
            if err > MAX_REL_ERR:
                raise SystemExit(f"{vname} on {name} M={m} is wrong: max relative error {err:.2e}")
            seconds = time_calls(fn, len(ws[fmt]), device)
            moved = bytes_w[fmt] + m * k * x.element_size() + m * n * x.element_size()
            row[vname] = {"us": round(seconds * 1e6, 3), "GBps": round(moved / seconds / 1e9, 1),
                          "max_rel_err": float(f"{err:.2e}")}
        for r in row.values():
            r["speedup_vs_bf16"] = round(row["bf16"]["us"] / r["us"], 3)
        int4 = {v: r for v, r in row.items() if v.startswith("int4")}
        row["best"] = min(int4, key=lambda v: int4[v]["us"])
        rows[str(m)] = row
        print(f"{name:8s} M={m:<3d} " + " ".join(f"{v}={r['us']:.1f}us({r['speedup_vs_bf16']:.2f}x,{r['GBps']:.0f}GB/s)"
                                                 for v, r in row.items() if isinstance(r, dict)), flush=True)
    del ws, deq
    return {"K": k, "N": n, "int4_group": group, "weight_bytes": bytes_w, "M": rows}


def crossover(shape_rows: dict) -> dict:
    """Per format, the smallest M from which the GEMM beats the GEMV; for W8A8, the smallest M from which the
    dispatch (with _scaled_mm there) beats the Triton W8A8 GEMM."""
    out = {}
    ms = sorted(int(m) for m in shape_rows["M"] if m.isdigit())
    for fmt in ("fp8", "int4"):
        wins = [m for m in ms if f"{fmt}_gemv" in shape_rows["M"][str(m)]
                and shape_rows["M"][str(m)][f"{fmt}_gemm"]["us"] < shape_rows["M"][str(m)][f"{fmt}_gemv"]["us"]]
        out[f"{fmt}_gemm_beats_gemv_from_M"] = wins[0] if wins else None
    for fmt in ("fp8", "int4"):
        wins = [m for m in ms if f"{fmt}_dqmm" in shape_rows["M"][str(m)]
                and shape_rows["M"][str(m)][f"{fmt}_dqmm"]["us"] < shape_rows["M"][str(m)][f"{fmt}_gemm"]["us"]]
        out[f"{fmt}_dqmm_beats_gemm_from_M"] = wins[0] if wins else None
    wins = [m for m in ms if "scaled_mm" in shape_rows["M"][str(m)] and "w8a8_triton" in shape_rows["M"][str(m)]
            and shape_rows["M"][str(m)]["scaled_mm"]["us"] < shape_rows["M"][str(m)]["w8a8_triton"]["us"]]
    out["scaled_mm_beats_triton_w8a8_from_M"] = wins[0] if wins else None
    return out


def plot(data: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    shapes = list(data["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        rows = data["shapes"][name]["M"]
        ms = sorted(int(m) for m in rows if m.isdigit())
        for v in ("scaled_mm", "fp8_w8a8", "fp8_gemv", "fp8_gemm", "fp8_dqmm", "int4_gemv", "int4_gemm", "int4_dqmm"):
            pts = [(m, rows[str(m)][v]["speedup_vs_bf16"]) for m in ms if v in rows[str(m)]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.axhline(1.0, color="k", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("speedup vs bf16 cuBLAS")
        ax.set_title(f"{name} K={data['shapes'][name]['K']} N={data['shapes'][name]['N']}")
        ax.legend(fontsize=7)
    fig.suptitle(f"QMatMul kernels vs bf16 cuBLAS, {data['machine']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="projection names (default: the 8B ones; SHAPES_1B names the 1.24B plan's)")
    ap.add_argument("--ms", type=int, nargs="*", default=None, help="rows (default: 1 2 4 8 16 64 256 2048)")
    ap.add_argument("--time-budget", type=float, default=160.0, help="seconds; later (shape, M) pairs are skipped")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--int4-gemv", action="store_true", help="only the INT4 GEMV variants against bf16, M = 1, 2")
    ap.add_argument("--int4-configs", type=str, nargs="*", default=None,
                    help="half2 configs BLOCK_N,TILE_K,WARPS for --int4-gemv (default: INT4_CONFIGS)")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (they are imported lazily)
    started = time.monotonic()
    deadline = started + args.time_budget
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU smoke run")
    dtype = torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [s for s in shapes + ([] if args.smoke else SHAPES_1B) if s[0] in args.shapes]
    ms = args.ms or (SMOKE_M if args.smoke else sorted(TABLE_M + CROSSOVER_M))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    from trtopt.plugins.qmatmul.gemm import SCALED_MM_MIN_ROWS
    from trtopt.plugins.qmatmul.kernel import GEMV_MAX_ROWS, XP_GEMV_MAX_ROWS

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data = {"benchmark": "bench_qmatmul", "date": now,
            "machine": {"gpu": gpu, "torch": torch.__version__, "triton": __import__("triton").__version__},
            "dtype": str(dtype), "GEMV_MAX_ROWS": GEMV_MAX_ROWS, "XP_GEMV_MAX_ROWS": XP_GEMV_MAX_ROWS,
            "SCALED_MM_MIN_ROWS": SCALED_MM_MIN_ROWS,
            "shapes": {}, "notes": []}
    gen = torch.Generator(device=device).manual_seed(0)
    if args.int4_gemv:
        from trtopt.plugins.qmatmul.kernel import INT4_GEMV_VARIANT

        configs = ([tuple(int(v) for v in c.split(",")) for c in args.int4_configs] if args.int4_configs is not None
                   else SMOKE_INT4_CONFIGS if args.smoke else INT4_CONFIGS)
        data.update(benchmark="bench_qmatmul --int4-gemv", INT4_GEMV_VARIANT=INT4_GEMV_VARIANT,
                    half2_configs=[list(c) for c in configs])
        for name, k, n in shapes:
            if time.monotonic() > deadline:
                data["notes"].append(f"time budget of {args.time_budget:.0f} s spent: later shapes were skipped")
                break
            data["shapes"][name] = run_int4_gemv(name, k, n, args.ms or INT4_GEMV_M, configs, device, dtype, gen)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        data["wall_s"] = round(time.monotonic() - started, 1)
        stem = f"qmatmul_int4_gemv_{'smoke_' if args.smoke else ''}{slug(gpu)}"
        out = args.out or ((Path("/tmp") if args.smoke else DOCS) / f"{stem}.json")
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out} ({data['wall_s']} s)")
        return
    for name, k, n in shapes:
        data["shapes"][name] = run_shape(name, k, n, ms, device, dtype, gen, deadline)
        data["shapes"][name]["crossover"] = crossover(data["shapes"][name])
        print(f"{name}: {data['shapes'][name]['crossover']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if time.monotonic() > deadline:
        data["notes"].append(f"time budget of {args.time_budget:.0f} s spent: later (shape, M) pairs were skipped")
    data["wall_s"] = round(time.monotonic() - started, 1)
    stem = f"qmatmul_smoke_{slug(gpu)}" if args.smoke else f"qmatmul_{slug(gpu)}"
    out = args.out or ((Path("/tmp") if args.smoke else DOCS) / f"{stem}.json")
    note = plot(data, out.with_suffix(".png"))
    if note:
        data["notes"].append(note)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out} ({data['wall_s']} s)")


if __name__ == "__main__":
    main()
