"""Does the state the L2 is left in before a timed call change decode attention's FP8-over-bf16 ratio?

    python benchmarks/l2_state_probe.py --out docs/benchmarks/l2_state_h200.json   # GPU

`triton.testing.do_bench` (bench_attention.py's timer before 2026-11-30, now its `l2="dirty"`) clears the L2
before each timed call by zeroing a 256 MB buffer: the L2 is then full of *dirty* lines, and the timed call pays
for writing them back to memory as its own reads evict them. A decode step never starts so: the kernels before
attention read weights and the previous layers' pools, which leave the L2 full of clean lines. For a call reading
~L2-sized data (B1·L32K's FP8 pool is 67 MB) the write-back is a large share of its time, and it is the same for
both pools, so it pulls their ratio towards 1.

This probe times the same CUDA graphs of one decode step (KV write, attention, split-KV merge) per pool and shape
under three conditions, medians of per-replay CUDA events:
- `write_flush`: do_bench's own (zeroing 256 MB before each replay);
- `read_flush`: a 256 MB read before each replay (a sum into one scalar): the L2 full of clean, unrelated lines;
- `layers`: no flush; one graph attends LAYERS copies of the pool in turn, as a model's layers do (each layer's
  reads evict the previous layer's clean lines); the time is per layer.
and, as a control with no attention in it, a plain read of the pools' byte counts (a sum) under both flushes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS = 4
FLUSH_BYTES = 256 * 1024 * 1024
SHAPES = [(64, 32, 8, 4096, 128), (1, 32, 8, 32768, 128), (16, 32, 8, 8192, 128), (1, 32, 8, 8192, 64)]


def median_ms(fn, flush, reps: int = 200) -> float:
    """Median of per-call CUDA-event times of fn, each call after flush() (None: back to back)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def profile_kernels(replay, label: str, reps: int = 20) -> None:
    """Each kernel's mean GPU time over reps replays (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    print(label)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="print each kernel's GPU time in the B1·L32K layers graphs (torch.profiler) and stop")
    args = ap.parse_args()

    from bench_attention import amax_scales, graphed, make_paged_decode
    from trtopt.plugins.paged_attention import decode_cuda
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton
    from trtopt.plugins.paged_attention.planning import _device_sm_count
    from trtopt.plugins.paged_attention.reference import quantized_pool

    flush_buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    flushes = {"write_flush": flush_buf.zero_, "read_flush": lambda: torch.sum(flush_buf, dim=0, out=sink)}
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "l2_bytes": getattr(props, "L2_cache_size", None), "layers": LAYERS,
              "flush_bytes": FLUSH_BYTES, "rows": [], "plain_reads": []}

    shapes = SHAPES[1:2] if args.profile else SHAPES
    pool_bytes = {2 * B * Hkv * L * D * size for B, _, Hkv, L, D in SHAPES for size in (1, 2)}
    for nbytes in [] if args.profile else sorted(pool_bytes):
        x = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
        out = torch.empty((), dtype=torch.int64, device="cuda")
        call = graphed(lambda: torch.sum(x, dim=0, out=out))
        cell = {"bytes": nbytes}
        for name, flush in flushes.items():
            cell[name + "_us"] = median_ms(call, flush) * 1e3
        result["plain_reads"].append(cell)
        print("plain read", cell, flush=True)
        del x

    paged = functools.partial(paged_attention_triton, state=PagedLaunchState())
    paged_triton = functools.partial(paged_attention_triton, state=PagedLaunchState(cuda_decode=False))
    for B, Hq, Hkv, L, D in shapes:
        step = make_paged_decode(B, Hq, Hkv, L, D)
        attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
        k_scale, v_scale = amax_scales(step["kv_cache"])
        fp8_pool = quantized_pool(step["kv_cache"], k_scale, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        planned = decode_cuda.plan_cuda_decode(B, Hkv, L, _device_sm_count(torch.device("cuda")), D)
        no_pdl = functools.partial(paged, launch=dataclasses.replace(planned, pdl=False))
        cells = {"bf16": (paged, step["kv_cache"], {}), "fp8": (paged, fp8_pool, scales),
                 "fp8_no_pdl": (no_pdl, fp8_pool, scales), "fp8_triton": (paged_triton, fp8_pool, scales)}
        row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·L{L}·D{D}"}
        for name, (fn, pool, sc) in cells.items():
            one = functools.partial(fn, **{**step, "kv_cache": pool}, **attrs, **sc)
            replay = graphed(one)
            cell = {"kv_bytes": 2 * B * Hkv * L * D * pool.element_size()}
            for flush_name, flush in flushes.items():
                cell[flush_name + "_us"] = median_ms(replay, flush) * 1e3
            pools = [pool] + [pool.clone() for _ in range(LAYERS - 1)]

            def all_layers(fn=fn, pools=pools, sc=sc):
                for p in pools:
                    fn(**{**step, "kv_cache": p}, **attrs, **sc)

            layers_replay = graphed(all_layers)
            cell["layers_us"] = median_ms(layers_replay, None) * 1e3 / LAYERS
            if args.profile:
                profile_kernels(layers_replay, f"{row['shape']} {name}")
            row[name] = cell
            del pools
            torch.cuda.empty_cache()
        for cond in ("write_flush", "read_flush", "layers"):
            row[f"fp8_speedup_{cond}"] = row["bf16"][cond + "_us"] / row["fp8"][cond + "_us"]
            for name in ("fp8_no_pdl", "fp8_triton"):
                row[f"{name}_speedup_{cond}"] = row["bf16"][cond + "_us"] / row[name][cond + "_us"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del step, fp8_pool
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
