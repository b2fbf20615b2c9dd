"""Attention kernel benchmark: trtopt's Triton kernels vs torch SDPA baselines measured in the same run.

    python benchmarks/bench_attention.py --out docs/benchmarks/attention_<gpu>.json   # on a CUDA machine
    python benchmarks/bench_attention.py --only decode_fp8 --out docs/benchmarks/attention_<gpu>.json  # one section
    python benchmarks/bench_attention.py --plot docs/benchmarks/attention_<gpu>.json  # anywhere with matplotlib
    python benchmarks/bench_attention.py --smoke      # decode_fp8 at tiny shapes on the CPU (TRITON_INTERPRET=1)

Prefill: FlashAttention TFLOP/s (causal FLOPs halved, the FA papers' convention) vs SDPA's cuDNN and flash backends.
Decode: PagedAttention over a randomly permuted block pool vs SDPA over the same keys in a contiguous cache,
reported as TB/s of KV read, next to the device-to-device copy bandwidth measured in the same run. Each kernel's
output is also checked against the baseline before it is timed, so a fast wrong kernel cannot post a number.
Decode FP8 (decode_fp8): the same decode steps through PagedAttention with bf16 pools and with float8_e4m3fn pools
(per-tensor scales amax / 448) in one run, planned as the runtime plans them (a PagedLaunchState, no launch given);
each output is checked against the torch reference over the dequantized pool first, and a cell that fails the check
is not timed. Reported per pool: TB/s of KV read, effective tokens/s (batch × context tokens read per second, one
layer) and the FP8 speedup over bf16 (issue #33's target: >= 1.7x).

A run with --only/--skip writes into an existing --out of the same GPU: the sections it did not run keep the file's
results (listed under "carried_over" with the date of the run that made them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFILL_SHAPES = [  # (batch, heads, seq, head_dim), bf16 causal
    (4, 32, 2048, 128),
    (1, 32, 8192, 128),
    (16, 16, 1024, 64),
]
DECODE_SHAPES = [  # (batch, q heads, kv heads, context, head_dim), bf16, one new token per sequence
    (64, 32, 8, 4096, 128),
    (1, 32, 8, 32768, 128),
    (16, 32, 8, 8192, 128),
]
# decode_fp8 also times the end-to-end benchmark model's attention (gpu_e2e.py: Llama-3.2-1B's shape, head_dim 64)
# at batch 1 after a short and a long prompt, whose engine rows time FP8 pools against bf16 (fp8_kv_e2e_h200.json:
# 0.95x when these shapes were added, 1.00x / 1.11x on 2026-11-30).
FP8_DECODE_SHAPES = DECODE_SHAPES + [
    (1, 32, 8, 128, 64),
    (1, 32, 8, 8192, 64),
]
BLOCK_SIZE = 16
# decode_fp8 under --smoke (CPU, Triton interpreter): DECODE_SHAPES scaled down, in float32 (the interpreter's bf16
# dots are wrong: the kernel tests run bf16 on GPUs only). The interpreter plans at most 4 key segments for 4 "SMs"
# (planning.py), so the long context at batch 1 is split-KV as B1·L32K is on a GPU.
SMOKE_DECODE_SHAPES = [  # (batch, q heads, kv heads, context, head_dim)
    (4, 4, 2, 64, 32),
    (1, 4, 2, 1024, 32),
    (2, 4, 2, 256, 32),
]
FP8_SPEEDUP_TARGET = 1.7  # issue #33: decode over FP8 pools vs bf16 pools
FP8_CHECK_REL_TOL = 2e-2  # max |kernel − reference| / max |reference| (bf16 dots and output; the reference is fp32)
SECTIONS = ("prefill", "decode", "decode_fp8", "paged_prefill", "copy_blocks")


# What each timed call finds in the L2 (bench_ms). Recorded per section in the JSON ("timers"); sections carried over
# from runs before it was recorded were timed with do_bench's flush, "dirty".
L2_FLUSH_BYTES = 256 * 1024 * 1024
TIMERS = {
    "clean": "CUDA events, median; before each call a 256 MB read (a sum) leaves the L2 full of clean lines",
    "dirty": "triton.testing.do_bench, median; before each call 256 MB zeroed leaves the L2 full of dirty lines",
}


@functools.cache
def _l2_flush(device: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=f"cuda:{device}"),
            torch.empty((), dtype=torch.float32, device=f"cuda:{device}"))


def bench_ms(fn, l2: str = "clean") -> float:
    """Median ms of fn (CUDA events), each call after 256 MB of other data went through the L2.

    l2="clean" reads them: the L2 then holds clean lines, as the kernels before attention in a decode step leave it
    (they read weights and the previous layers' pools). l2="dirty" is triton.testing.do_bench, which zeroes them:
    the timed call then also pays for writing ~an L2 of dirty lines back as its reads evict them, a cost no decode
    step has, the same for every pool dtype, that pulls the FP8/bf16 ratio towards 1 where the pool is about the
    L2's size (B1·L32K: ~6 µs of the FP8 pool's 33; docs/benchmarks/l2_state_h200.json)."""
    if l2 == "dirty":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))
    buf, sink = _l2_flush(torch.cuda.current_device())
    flush = functools.partial(torch.sum, buf, dim=0, out=sink)
    for _ in range(5):
        flush()
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(50, min(1000, int(300 / max(start.elapsed_time(end) / 5, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends):
        flush()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return float(times[len(times) // 2])


def graphed(fn):
    """fn captured into a CUDA graph (after three warm-up calls on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_graph_ms(fn, l2: str = "clean") -> float:
    """Time fn as a replayed CUDA graph: what the runtime's decode path does, with no host launch overhead."""
    return bench_ms(graphed(fn), l2)


def host_ms(fn, reps: int = 2) -> float:
    """Median wall time of fn on the host: the timer of the CPU smoke run, which checks the code, not the speed."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def timer(device: torch.device):
    """The ms timer for kernels on device: CUDA events (do_bench) on a GPU, wall time under the interpreter."""
    return bench_ms if device.type == "cuda" else host_ms


def copy_bandwidth_tbs(device: torch.device = torch.device("cuda")) -> float:
    """Device-to-device copy of 1 GiB (64 MiB on the CPU): bytes read + written per second."""
    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(device)(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e9


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def run_sdpa(backend, q, k, v, causal: bool, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def bench_prefill() -> list[dict]:
    from trtopt.plugins.flash_attention.kernel import (
        _flash_fwd_kernel, _tma_eligible, flash_attention_flops, flash_attention_triton,
    )

    rows = []
    for B, H, S, D in PREFILL_SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = flash_attention_flops(B, H, S, S, D, causal=True)
        row = {"shape": f"B{B}·H{H}·S{S}·D{D}", "batch": B, "heads": H, "seq": S, "head_dim": D, "flops": flops}
        triton_fn = lambda: flash_attention_triton(q, k, v, num_heads=H, num_kv_heads=H, head_dim=D,  # noqa: E731
                                                   scale=D**-0.5, causal=1)
        want = None
        for name, backend in sdpa_backends().items():
            try:
                got = run_sdpa(backend, q, k, v, True, False)
                want = got if want is None else want
                ms = bench_ms(lambda: run_sdpa(backend, q, k, v, True, False))
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            except RuntimeError as err:  # a backend that does not take this shape says so
                row[name] = {"error": str(err).splitlines()[0][:200]}
        out = triton_fn()
        row["max_abs_err_vs_sdpa"] = float((out.float() - want.float()).abs().max())
        ms = bench_ms(triton_fn)
        timings = getattr(_flash_fwd_kernel, "configs_timings", None) or {}
        row["triton"] = {"ms": ms, "tflops": flops / ms / 1e9,
                         "config": str(getattr(_flash_fwd_kernel, "best_config", None)),
                         "autotune_ms": {str(c): (t[0] if isinstance(t, (list, tuple)) else t)
                                         for c, t in timings.items()}}
        row["triton"]["tma"] = _tma_eligible(q, k, v, out)
        pointer_fn = lambda: flash_attention_triton(q, k, v, num_heads=H, num_kv_heads=H,  # noqa: E731
                                                    head_dim=D, scale=D**-0.5, causal=1, use_tma=False)
        p_err = float((pointer_fn().float() - want.float()).abs().max())
        p_ms = bench_ms(pointer_fn)
        row["triton_pointer_loads"] = {"ms": p_ms, "tflops": flops / p_ms / 1e9, "max_abs_err_vs_sdpa": p_err,
                                       "config": str(getattr(_flash_fwd_kernel, "best_config", None))}
        for name in ("sdpa_cudnn", "sdpa_flash"):
            if "tflops" in row.get(name, {}):
                row[f"speedup_vs_{name}"] = row["triton"]["tflops"] / row[name]["tflops"]
        rows.append(row)
        print(f"prefill {row['shape']}: triton {row['triton']['tflops']:.0f} TFLOP/s (tma={row['triton']['tma']}; "
              f"pointer loads {row['triton_pointer_loads']['tflops']:.0f}), "
              f"cudnn {row['sdpa_cudnn'].get('tflops', float('nan')):.0f}, "
              f"flash {row['sdpa_flash'].get('tflops', float('nan')):.0f}, err {row['max_abs_err_vs_sdpa']:.3g}",
              flush=True)
    return rows


def make_paged_decode(B: int, Hq: int, Hkv: int, L: int, D: int, dtype=torch.bfloat16, *, device="cuda",
                      table_blocks: int = 0):
    """A decode step over a permuted pool, plus the same keys as a contiguous [B, Hkv, L, D] cache.

    table_blocks: the block tables' width, padded with the null block 0 as the runtime's CUDA graphs pad them to
    max_blocks_per_seq (cuda_graphs.pad_step); 0 = as wide as the context (the runtime's eager tables)."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-L // BLOCK_SIZE)
    num_blocks = B * blocks_per_seq + 1  # + the null block 0
    pool = torch.randn(num_blocks, 2, Hkv, BLOCK_SIZE, D, device=device, dtype=dtype, generator=gen)
    tables = (torch.randperm(num_blocks - 1, device=device, generator=gen) + 1).to(torch.int32)
    tables = tables.view(B, blocks_per_seq)
    if table_blocks > blocks_per_seq:
        tables = torch.nn.functional.pad(tables, (0, table_blocks - blocks_per_seq))
    tables = tables.contiguous()
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    last = L - 1
    slots = (tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE).contiguous()
    q = torch.randn(1, Hq, B, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, Hkv, B, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, Hkv, B, D, device=device, dtype=dtype, generator=gen)
    return dict(q=q, k=k, v=v, kv_cache=pool, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                slot_mapping=slots)


def contiguous_cache(step: dict, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the pool into [B, Hkv, L, D] K and V (after the paged write, so both see the same keys)."""
    blocks = step["kv_cache"][step["block_tables"].long()]  # [B, nb, 2, Hkv, bs, D]
    kv = blocks.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :L]  # [2, B, Hkv, L, D]
    return kv[0].contiguous(), kv[1].contiguous()


def bench_decode(copy_tbs: float) -> list[dict]:
    from trtopt.plugins.paged_attention.kernel import (
        PagedLaunch, PagedLaunchState, paged_attention_triton, plan_paged_launch, write_kv_triton,
    )

    # The calls plan once per step shape and keep it, as the executor's do (its PagedLaunchState).
    paged = functools.partial(paged_attention_triton, state=PagedLaunchState())
    rows = []
    for B, Hq, Hkv, L, D in DECODE_SHAPES:
        step = make_paged_decode(B, Hq, Hkv, L, D)
        attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
        kv_bytes = 2 * B * Hkv * L * D * step["q"].element_size()
        row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·L{L}·D{D}", "batch": B, "q_heads": Hq, "kv_heads": Hkv,
               "context": L, "head_dim": D, "kv_bytes": kv_bytes, "block_size": BLOCK_SIZE}
        out, _ = paged(**step, **attrs)
        k_c, v_c = contiguous_cache(step, L)
        q_b = step["q"][0].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
        # SDPA baseline over the contiguous cache (no write: that favours the baseline slightly).
        want = None
        for name, backend in sdpa_backends().items():
            try:
                got = run_sdpa(backend, q_b, k_c, v_c, False, True)
                want = got if want is None else want
                ms = bench_ms(lambda: run_sdpa(backend, q_b, k_c, v_c, False, True))
                row[name] = {"ms": ms, "tbs": kv_bytes / ms / 1e9}
                try:
                    g_ms = bench_graph_ms(lambda: run_sdpa(backend, q_b, k_c, v_c, False, True))
                    row[name].update(graph_ms=g_ms, graph_tbs=kv_bytes / g_ms / 1e9)
                except RuntimeError as err:
                    row[name]["graph_error"] = str(err).splitlines()[0][:200]
            except RuntimeError as err:
                row[name] = {"error": str(err).splitlines()[0][:200]}
        if want is not None:
            row["max_abs_err_vs_sdpa"] = float((out[0].transpose(0, 1).float() - want[:, :, 0].float()).abs().max())
        # The default (shape-planned) launch, which includes the KV write, then a small sweep of tilings.
        plan = plan_paged_launch(B, B, Hkv, Hq // Hkv, step["block_tables"].shape[1] * BLOCK_SIZE,
                                 torch.cuda.get_device_properties(0).multi_processor_count)
        ms = bench_ms(lambda: paged(**step, **attrs))
        g_ms = bench_graph_ms(lambda: paged(**step, **attrs))
        row["triton"] = {"ms": ms, "tbs": kv_bytes / ms / 1e9, "launch": plan.__dict__, "graph_ms": g_ms,
                         "graph_tbs": kv_bytes / g_ms / 1e9}
        row["kv_write_ms"] = bench_ms(lambda: write_kv_triton(step["k"], step["v"], step["kv_cache"],
                                                              step["slot_mapping"]))
        sweep = []
        for tile_n in (32, 64, 128):
            for stages in (3, 4):
                for segs in sorted({1, plan.num_segments, 2 * plan.num_segments, max(1, plan.num_segments // 2)}):
                    launch = PagedLaunch(block_q=plan.block_q, tile_n=tile_n, num_segments=segs, num_warps=4,
                                         num_stages=stages)
                    try:
                        got, _ = paged(**step, **attrs, launch=launch)
                        err = float((got.float() - out.float()).abs().max())
                        t = bench_ms(lambda: paged(**step, **attrs, launch=launch))
                        sweep.append({**launch.__dict__, "ms": t, "tbs": kv_bytes / t / 1e9, "max_abs_err": err})
                    except Exception as exc:  # noqa: BLE001 - a config that fails to compile is recorded, not fatal
                        sweep.append({**launch.__dict__, "error": repr(exc)[:200]})
        row["sweep"] = sweep
        best = min((s for s in sweep if "ms" in s), key=lambda s: s["ms"])
        row["best_sweep"] = best
        row["copy_tbs"] = copy_tbs
        for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
            if "ms" in row.get(name, {}):
                row[f"speedup_vs_{name}"] = row[name]["ms"] / row["triton"]["ms"]
            if "graph_ms" in row.get(name, {}):
                row[f"graph_speedup_vs_{name}"] = row[name]["graph_ms"] / row["triton"]["graph_ms"]
        rows.append(row)
        print(f"decode {row['shape']}: triton {row['triton']['tbs']:.2f} TB/s ({ms:.3f} ms, plan {plan}), "
              f"best sweep {best['tbs']:.2f} TB/s ({best}), "
              + ", ".join(f"{n} {row[n].get('tbs', float('nan')):.2f}" for n in sdpa_backends())
              + f", copy {copy_tbs:.2f}, write {row['kv_write_ms'] * 1e3:.1f} us; graphs: triton "
              f"{row['triton']['graph_tbs']:.2f}, "
              + ", ".join(f"{n} {row[n].get('graph_tbs', float('nan')):.2f}" for n in sdpa_backends()), flush=True)
        del step, k_c, v_c
        torch.cuda.empty_cache()
    return rows


def amax_scales(pool: torch.Tensor) -> tuple[float, float]:
    """Per-tensor k_scale, v_scale = amax / 448: what a calibration of this pool would set (benchmarks/fp8_kv.py)."""
    from trtopt.signature import FP8_E4M3_MAX

    return tuple(float(pool[:, i].abs().amax().float()) / FP8_E4M3_MAX for i in (0, 1))


def reference_rel_err(out: torch.Tensor, step: dict, attrs: dict, *, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> float:
    """max |out − reference| / max |reference|: the torch reference in fp32 over the pool as the kernel left it
    (its own write included), dequantized. The reference writes nothing (slots −1), so both read the same keys."""
    from trtopt.plugins.paged_attention.reference import from_pool, paged_attention_ref, pool_values

    pool = step["kv_cache"]
    plain = torch.empty(pool.shape, dtype=torch.float32, device=pool.device)
    plain[:, 0] = from_pool(pool[:, 0], k_scale, torch.float32)
    plain[:, 1] = from_pool(pool_values(pool), v_scale, torch.float32)  # an FP8 pool's values in key order
    want, _ = paged_attention_ref(
        step["q"].float(), step["k"].float(), step["v"].float(), plain, step["block_tables"], step["seq_lens"],
        step["query_start_loc"], torch.full_like(step["slot_mapping"], -1), **attrs)
    return float((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def time_decode_cell(call, kv_bytes: int, tokens: int, device: torch.device) -> dict:
    """ms, TB/s of KV read and effective tokens/s (tokens = batch × context) of call: eager (each call through the
    plan's prepared launches), and on a GPU replayed from a CUDA graph too (the runtime's decode path)."""
    ms = timer(device)(call)
    cell = {"ms": ms, "tbs": kv_bytes / ms / 1e9, "tokens_per_s": tokens / ms * 1e3}
    if device.type == "cuda":
        g_ms = bench_graph_ms(call)
        cell.update(graph_ms=g_ms, graph_tbs=kv_bytes / g_ms / 1e9, graph_tokens_per_s=tokens / g_ms * 1e3,
                    graph_ms_dirty_l2=bench_graph_ms(call, "dirty"))  # do_bench's flush, for comparison
    return cell


def fp8_speedups(row: dict, base: str) -> dict:
    """fp8_speedup_vs_<base> (base pool's time / FP8 pool's time) from graph replays where there are (the runtime's
    decode path), else eager; the eager ratio beside it; and whether it meets FP8_SPEEDUP_TARGET."""
    ref, fp8 = row.get(base, {}), row.get("fp8", {})
    if "ms" not in ref or "ms" not in fp8:
        return {}
    basis = "graph" if "graph_ms" in ref and "graph_ms" in fp8 else "eager"
    key = "graph_ms" if basis == "graph" else "ms"
    speedup = ref[key] / fp8[key]
    out = {f"fp8_speedup_vs_{base}": speedup, "speedup_basis": basis,
           f"eager_fp8_speedup_vs_{base}": ref["ms"] / fp8["ms"], "target": FP8_SPEEDUP_TARGET,
           "meets_target": speedup >= FP8_SPEEDUP_TARGET}
    if "graph_ms_dirty_l2" in ref and "graph_ms_dirty_l2" in fp8:
        out[f"dirty_l2_fp8_speedup_vs_{base}"] = ref["graph_ms_dirty_l2"] / fp8["graph_ms_dirty_l2"]
    return out


def fp8_tiling_sweep(call, planned_out: torch.Tensor, plan, kv_bytes: int, device: torch.device) -> list[dict]:
    """The FP8 pool's step under tilings around its plan (key tile × segments × stages), replayed from CUDA graphs
    on a GPU (a launch given is not planned: each call goes through Triton's dispatcher). Whether FP8 pools want
    other plans: plan_paged_launch's thresholds come from these. Four warps only: eight were slower in every cell of
    the sweep in docs/benchmarks/fp8_decode_sweeps_h200.json (run acb92dc), 256-key tiles and four stages never
    best by more than 1%."""
    sweep = []
    cuda = device.type == "cuda"
    segment_choices = {plan.num_segments, max(1, plan.num_segments // 2), min(64, 2 * plan.num_segments)}
    if cuda and plan.num_segments >= 4:
        segment_choices.add(plan.num_segments // 4)
    for tile_n, segments, num_warps, num_stages in itertools.product(
            (32, 64, 128) if cuda else (16, 32), sorted(segment_choices), (4,), (2, 3) if cuda else (1,)):
        launch = dataclasses.replace(plan, tile_n=tile_n, num_segments=segments, num_warps=num_warps,
                                     num_stages=num_stages)
        fn = functools.partial(call, launch=launch)
        try:
            got, _ = fn()
            diff = float((got.float() - planned_out.float()).abs().max() / planned_out.float().abs().max())
            ms = (bench_graph_ms if device.type == "cuda" else host_ms)(fn)
            sweep.append({**launch.__dict__, "ms": ms, "tbs": kv_bytes / ms / 1e9, "rel_diff_vs_planned": diff})
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is recorded, not fatal
            sweep.append({**launch.__dict__, "error": repr(exc)[:200]})
    return sweep


def bench_decode_fp8(copy_tbs: float, *, shapes=FP8_DECODE_SHAPES,
                     device: torch.device = torch.device("cuda"),
                     dtype: torch.dtype = torch.bfloat16, max_model_len: int = 0, sweep: bool = False) -> list[dict]:
    """Decode through PagedAttention with a pool of the model's dtype (bf16) and the same pool in FP8, per shape.
    Each row holds a cell per pool ("bf16", "fp8"; the smoke run's base is "fp32") and fp8_speedup_vs_bf16. On a
    GPU the FP8 pool's planned call takes the CUDA decode kernel where it serves the step (decode_cuda.py;
    `fp8_kernel` says which ran, `launch` its plan), and a third cell ("fp8_triton", fp8_triton_speedup_vs_bf16)
    times the same pool through the Triton kernel.

    The calls go through one PagedLaunchState with no launch given, so the kernel plans each step as the runtime's
    executor does (plan_paged_launch: split-KV for long contexts at small batch). max_model_len > 0 pads the block
    tables to its blocks, as the runtime's CUDA graphs pad them (the plan reads the tables' width). sweep: time the
    FP8 pool under other tilings too (fp8_tiling_sweep), graph replays against the planned call's graph replay."""
    from trtopt.plugins.launcher import Launcher
    from trtopt.plugins.paged_attention import decode_cuda
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton, plan_paged_launch
    from trtopt.plugins.paged_attention.planning import _device_sm_count
    from trtopt.plugins.paged_attention.reference import quantized_pool

    paged = functools.partial(paged_attention_triton, state=PagedLaunchState())
    # the FP8 pool through the Triton kernel too (decode_cuda.py's CUDA kernel takes FP8 decode steps on a GPU)
    paged_triton = functools.partial(paged_attention_triton, state=PagedLaunchState(cuda_decode=False))
    base = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    rows = []
    for B, Hq, Hkv, L, D in shapes:
        table_blocks = -(-max_model_len // BLOCK_SIZE)
        step = make_paged_decode(B, Hq, Hkv, L, D, dtype, device=device, table_blocks=table_blocks)
        attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
        k_scale, v_scale = amax_scales(step["kv_cache"])
        # The plan the call below makes for itself (attention.py passes these arguments to plan_paged_launch).
        width = step["block_tables"].shape[1] * BLOCK_SIZE
        plan = plan_paged_launch(B, B, Hkv, Hq // Hkv, width, _device_sm_count(device),
                                 interpret=device.type != "cuda", kv_bytes=1)  # the FP8 pool's plan (the row's launch)
        row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·L{L}·D{D}", "batch": B, "q_heads": Hq, "kv_heads": Hkv, "context": L,
               "head_dim": D, "block_size": BLOCK_SIZE, "planned_max_context": width, "launch": plan.__dict__,
               "split_kv": plan.num_segments > 1, "k_scale": k_scale, "v_scale": v_scale, "copy_tbs": copy_tbs,
               "baseline": base}
        fp8_step = {**step, "kv_cache": quantized_pool(step["kv_cache"], k_scale, v_scale)}
        fp8_scales = dict(k_scale=k_scale, v_scale=v_scale)
        cells = {base: (step, {}), "fp8": (fp8_step, fp8_scales)}
        if device.type == "cuda":
            cells["fp8_triton"] = (fp8_step, fp8_scales)
            cuda_plan = decode_cuda.choose(step["q"], fp8_step["kv_cache"], num_tokens=B, num_seqs=B, group=Hq // Hkv,
                                           head_dim=D, alibi_slopes=None, launcher=Launcher(), max_context=width,
                                           sm_count=_device_sm_count(device))  # the planned call's own choice
            row["fp8_kernel"] = "cuda" if cuda_plan is not None else "triton"
            if cuda_plan is not None:
                row["launch"] = cuda_plan.__dict__
        outs = {}
        for name, (s, scales) in cells.items():
            call = functools.partial(paged_triton if name == "fp8_triton" else paged, **s, **attrs, **scales)
            outs[name], _ = call()
            kv_bytes = 2 * B * Hkv * L * D * s["kv_cache"].element_size()
            cell = {"pool_dtype": str(s["kv_cache"].dtype).removeprefix("torch."), "kv_bytes": kv_bytes,
                    "rel_err_vs_ref": reference_rel_err(outs[name], s, attrs, **scales)}
            if not cell["rel_err_vs_ref"] <= FP8_CHECK_REL_TOL:  # NaN fails too
                cell["error"] = f"output off the reference by {cell['rel_err_vs_ref']:.3g} of its max: not timed"
                print(f"decode_fp8 {row['shape']} {name}: {cell['error']}", flush=True)
            else:
                cell.update(time_decode_cell(call, kv_bytes, B * L, device))
            row[name] = cell
        # The quantization's own effect on the output (information, not a check).
        row[f"fp8_rel_diff_vs_{base}"] = float((outs["fp8"].float() - outs[base].float()).abs().max()
                                               / outs[base].float().abs().max().clamp_min(1e-30))
        row.update(fp8_speedups(row, base))
        if "fp8_triton" in row and "ms" in row["fp8_triton"] and "ms" in row[base]:
            key = "graph_ms" if "graph_ms" in row["fp8_triton"] else "ms"
            row[f"fp8_triton_speedup_vs_{base}"] = row[base][key] / row["fp8_triton"][key]
        if sweep and "ms" in row["fp8"]:
            fp8_step, scales = cells["fp8"]
            row["fp8_sweep"] = fp8_tiling_sweep(functools.partial(paged, **fp8_step, **attrs, **scales), outs["fp8"],
                                                plan, row["fp8"]["kv_bytes"], device)
            timed = [c for c in row["fp8_sweep"] if "ms" in c]
            if timed:
                row["fp8_best_sweep"] = min(timed, key=lambda c: c["ms"])
                ref_ms = row[base].get("graph_ms", row[base].get("ms"))
                if ref_ms:
                    row[f"fp8_best_sweep_speedup_vs_{base}"] = ref_ms / row["fp8_best_sweep"]["ms"]
        rows.append(row)
        print(f"decode_fp8 {row['shape']}: {row.get('fp8_kernel', 'triton')} plan {row['launch']} "
              f"(max context {width}); "
              + "; ".join(f"{n} {row[n].get('tbs', float('nan')):.2f} TB/s {row[n].get('tokens_per_s', 0) / 1e6:.1f} "
                          f"Mtok/s (graph {row[n].get('graph_tbs', float('nan')):.2f} TB/s), err "
                          f"{row[n]['rel_err_vs_ref']:.2g}" for n in cells)
              + f"; fp8 speedup {row.get(f'fp8_speedup_vs_{base}', float('nan')):.2f}x ({row.get('speedup_basis')}, "
              f"eager {row.get(f'eager_fp8_speedup_vs_{base}', float('nan')):.2f}x, target {FP8_SPEEDUP_TARGET}x)",
              flush=True)
        del step, cells, outs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_paged_prefill() -> list[dict]:
    """Prefill through the paged kernel (4 × 2048 new tokens) vs the FlashAttention kernel on the same data."""
    from trtopt.plugins.flash_attention.kernel import flash_attention_flops, flash_attention_triton
    from trtopt.plugins.paged_attention.kernel import PagedLaunch, PagedLaunchState, paged_attention_triton

    paged = functools.partial(paged_attention_triton, state=PagedLaunchState())  # as the executor's calls
    B, Hq, Hkv, S, D = 4, 32, 8, 2048, 128
    bs = BLOCK_SIZE
    nb = S // bs
    pool = torch.zeros(B * nb + 1, 2, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
    tables = (torch.randperm(B * nb, device="cuda") + 1).to(torch.int32).view(B, nb).contiguous()
    pos = torch.arange(S, device="cuda")
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).flatten().contiguous()
    q = torch.randn(1, Hq, B * S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, B * S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, Hkv, B * S, D, device="cuda", dtype=torch.bfloat16)
    step = dict(q=q, k=k, v=v, kv_cache=pool, block_tables=tables,
                seq_lens=torch.full((B,), S, dtype=torch.int32, device="cuda"),
                query_start_loc=torch.arange(0, B * S + 1, S, dtype=torch.int32, device="cuda"), slot_mapping=slots)
    attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
    flops = flash_attention_flops(B, Hq, S, S, D, causal=True)
    out, _ = paged(**step, **attrs)
    qb, kb, vb = (x[0].unflatten(1, (B, S)).transpose(0, 1) for x in (q, k, v))  # [B, H, S, D] views
    ref = flash_attention_triton(qb, kb, vb, **attrs, causal=1)
    err = float((out[0].unflatten(1, (B, S)).transpose(0, 1).float() - ref.float()).abs().max())
    paged_ms = bench_ms(lambda: paged(**step, **attrs))
    flash_ms = bench_ms(lambda: flash_attention_triton(qb, kb, vb, **attrs, causal=1))
    sweep = []
    for rows in (64, 128):
        for tile_n in (32, 64, 128):
            for warps in (4, 8):
                launch = PagedLaunch(block_q=rows // (Hq // Hkv), tile_n=tile_n, num_segments=1, num_warps=warps,
                                     num_stages=3)
                try:
                    got, _ = paged(**step, **attrs, launch=launch)
                    e = float((got.float() - out.float()).abs().max())
                    t = bench_ms(lambda: paged(**step, **attrs, launch=launch))
                    sweep.append({**launch.__dict__, "ms": t, "tflops": flops / t / 1e9, "max_abs_err": e})
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is recorded, not fatal
                    sweep.append({**launch.__dict__, "error": repr(exc)[:200]})
    best = min((x for x in sweep if "ms" in x), key=lambda x: x["ms"])
    row = {"shape": f"B{B}·Hq{Hq}·Hkv{Hkv}·S{S}·D{D}", "paged": {"ms": paged_ms, "tflops": flops / paged_ms / 1e9},
           "flash": {"ms": flash_ms, "tflops": flops / flash_ms / 1e9}, "max_abs_err": err, "sweep": sweep,
           "best_sweep": best}
    print(f"paged prefill sweep best: {best}", flush=True)
    print(f"paged prefill {row['shape']}: paged {row['paged']['tflops']:.0f} TFLOP/s vs flash kernel "
          f"{row['flash']['tflops']:.0f}, err {err:.3g}", flush=True)
    return [row]


def bench_copy_blocks(copy_tbs: float) -> dict:
    """copy_blocks over 30 layers' pools (SmolLM2-like) moving 256 blocks each."""
    from trtopt.plugins.paged_attention.kernel import copy_blocks_triton

    caches = [torch.randn(2049, 2, 3, BLOCK_SIZE, 64, device="cuda", dtype=torch.bfloat16) for _ in range(30)]
    perm = torch.randperm(2048, device="cuda") + 1
    pairs = torch.stack([perm[:256], perm[256:512]], dim=1).contiguous()
    want = [c.clone() for c in caches[:2]]
    copy_blocks_triton(caches, pairs)
    for w in want:
        w[pairs[:, 1]] = w[pairs[:, 0]]
    assert all(torch.equal(w, c) for w, c in zip(want, caches[:2])), "copy_blocks kernel moved the wrong data"
    ms = bench_ms(lambda: copy_blocks_triton(caches, pairs))
    moved = 2 * 30 * 256 * caches[0][0].numel() * caches[0].element_size()
    return {"layers": 30, "pairs": 256, "ms": ms, "tbs": moved / ms / 1e9, "copy_tbs": copy_tbs}


def environment(device: torch.device = torch.device("cuda")) -> dict:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if device.type != "cuda":
        return {"gpu": f"{device.type} (TRITON_INTERPRET=1 smoke)", **env}
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "sm_count": props.multi_processor_count, **env, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def section_date(data: dict, section: str) -> str:
    """The date of the run a section's rows come from (a section carried over keeps its run's)."""
    return data.get("carried_over", {}).get(section, data["env"]["date"])[:10]


def plot_prefill(ax, data: dict) -> None:
    names = ["triton", "sdpa_cudnn", "sdpa_flash"]
    width = 0.27
    for i, name in enumerate(names):
        vals = [r.get(name, {}).get("tflops", 0.0) for r in data["prefill"]]
        ax.bar([x + (i - 1) * width for x in range(len(vals))], vals, width, label=name)
    ax.set_xticks(range(len(data["prefill"])), [r["shape"] for r in data["prefill"]], fontsize=8)
    ax.set_ylabel("TFLOP/s (causal, bf16)")
    ax.set_title(f"Prefill: FlashAttention kernel vs SDPA ({section_date(data, 'prefill')})")
    ax.legend()


def plot_decode(ax, data: dict) -> None:
    # Backends that took none of the shapes (SDPA's efficient kernel rejects GQA decode) are left out.
    names = [n for n in ("triton", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
             if any("tbs" in r.get(n, {}) for r in data["decode"])]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [r.get(name, {}).get("tbs", 0.0) for r in data["decode"]]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(vals))], vals, width, label=name)
    ax.axhline(data["copy_tbs"], color="k", linestyle="--", label="D2D copy (read+write)")
    ax.set_xticks(range(len(data["decode"])), [r["shape"] for r in data["decode"]], fontsize=7)
    ax.set_ylabel("TB/s of KV read")
    ax.set_title(f"Decode: PagedAttention (paged pool) vs SDPA (contiguous) ({section_date(data, 'decode')})")
    ax.set_ylim(0, data["copy_tbs"] * 1.25)
    ax.legend(fontsize=8, loc="upper center", ncol=4)


def plot_decode_fp8(ax, data: dict) -> None:
    """The FP8 pool's speedup over the baseline pool per shape (graph replays where measured), each bar labelled
    with both times and the FP8 read's TB/s; the shapes' times differ by 20x, so speedups share one axis."""
    rows = data["decode_fp8"]
    base = rows[0]["baseline"]

    def ms(cell: dict) -> float:
        return cell.get("graph_ms", cell.get("ms", float("nan")))

    for x, r in enumerate(rows):
        speedup = r.get(f"fp8_speedup_vs_{base}")
        if speedup is None:
            continue
        triton = r.get(f"fp8_triton_speedup_vs_{base}")
        width = 0.6 if triton is None else 0.4
        bar = ax.bar(x - (0 if triton is None else 0.2), speedup, width, color="C1" if r["meets_target"] else "C0",
                     label=None if x else f"FP8 pool, {r.get('fp8_kernel', 'triton')} kernel (planned)")
        fp8 = r["fp8"]
        ax.bar_label(bar, [f"{speedup:.2f}x\n{base} {ms(r[base]) * 1e3:.1f} µs\nfp8 {ms(fp8) * 1e3:.1f} µs\n"
                           f"{fp8.get('graph_tbs', fp8.get('tbs', 0.0)):.2f} TB/s"], fontsize=7)
        if triton is not None:
            tbar = ax.bar(x + 0.2, triton, width, color="0.7", label=None if x else "FP8 pool, Triton kernel")
            ax.bar_label(tbar, [f"{triton:.2f}x"], fontsize=7)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(FP8_SPEEDUP_TARGET, color="C3", linestyle="--", label=f"target {FP8_SPEEDUP_TARGET}x")
    labels = []
    for r in rows:
        launch = r["launch"]
        tiling = (f"{launch['num_segments']} seg × {launch['tile_n']} keys" if "tile_n" in launch
                  else f"CUDA: {launch['num_segments']} seg, {launch.get('stages', 0)} stages")
        labels.append(f"B{r['batch']}·L{r['context']}·D{r['head_dim']}\n{tiling}")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(f"FP8 pool speedup over {base} (time ratio)")
    timer = data.get("timers", {}).get("decode_fp8", "dirty")
    ax.set_title(f"Decode: PagedAttention, FP8 vs {base} KV pool (Hq32·Hkv8)\ngraph replays, {timer} L2 before each "
                 f"({section_date(data, 'decode_fp8')})", fontsize=10)
    ax.set_ylim(0, max([FP8_SPEEDUP_TARGET] + [r.get(f"fp8_speedup_vs_{base}", 0.0) for r in rows]) * 1.45)
    ax.legend(fontsize=8, loc="upper right")


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    panels = [(name, fn) for name, fn in (("prefill", plot_prefill), ("decode", plot_decode),
                                          ("decode_fp8", plot_decode_fp8)) if data.get(name)]
    assert panels, f"{path} holds none of the plotted sections (prefill, decode, decode_fp8)"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (_, fn) in zip(axes[0], panels):
        fn(ax, data)
    fig.suptitle(f"{data['env']['gpu']} · torch {data['env']['torch']} · triton {data['env']['triton']} · "
                 f"{data['env']['date']}", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def sections_to_run(only: str, skip: str) -> list[str]:
    chosen = set(filter(None, only.split(","))) or set(SECTIONS)
    skipped = set(filter(None, skip.split(",")))
    unknown = (chosen | skipped) - set(SECTIONS)
    if unknown:
        sys.exit(f"unknown section(s) {sorted(unknown)}; the sections are {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in chosen - skipped]


def write_results(out: Path, results: dict, ran: list[str]) -> None:
    """Write results to out. The sections this run skipped keep what out already held for the same GPU (listed in
    "carried_over" with the date of the run that made them); the others are left empty."""
    old = json.loads(out.read_text()) if out.is_file() and len(ran) < len(SECTIONS) else {}
    if old and old.get("env", {}).get("gpu") != results["env"]["gpu"]:
        sys.exit(f"{out} holds results of {old.get('env', {}).get('gpu')}, not {results['env']['gpu']}: "
                 "pass another --out")
    carried = dict(old.get("carried_over", {}))
    timers = {s: old.get("timers", {}).get(s, "dirty") for s in SECTIONS if old.get(s)}
    for section in SECTIONS:
        if section in ran:
            carried.pop(section, None)
            timers[section] = "clean"
        elif old.get(section):
            results[section] = old[section]
            carried.setdefault(section, old["env"]["date"])
        else:
            results[section] = {} if section == "copy_blocks" else []
    if carried:
        results["carried_over"] = carried
    results["timers"] = {s: timers[s] for s in SECTIONS if s in timers}  # keys of TIMERS
    results["timer_kinds"] = TIMERS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def merge_fp8_kv_speedups(path: Path, rows: list[dict]) -> None:
    """Set `decode_speedup_vs_bf16.attention_per_shape` in issue 33's fp8_kv_<gpu>.json (its other keys are
    benchmarks/fp8_kv.py's and gpu_e2e.py's, and are kept) from a GPU run's decode_fp8 rows."""
    data = json.loads(path.read_text())
    per_shape = {"source": "benchmarks/bench_attention.py decode_fp8 (attention_<gpu>.json), same run as its bf16 "
                           "cells; graph replays after a clean-L2 flush (dirty_l2: do_bench's flush)"}
    for row in rows:
        if "fp8_speedup_vs_bf16" in row:
            per_shape[row["shape"]] = {
                "fp8_kernel": row.get("fp8_kernel"), "launch": row["launch"],
                "fp8_speedup_vs_bf16": row["fp8_speedup_vs_bf16"],
                "dirty_l2_fp8_speedup_vs_bf16": row.get("dirty_l2_fp8_speedup_vs_bf16"),
                "fp8_triton_speedup_vs_bf16": row.get("fp8_triton_speedup_vs_bf16"), "basis": row["speedup_basis"]}
    data.setdefault("decode_speedup_vs_bf16", {})["attention_per_shape"] = per_shape
    path.write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON results (needs CUDA, or --smoke)")
    parser.add_argument("--plot", type=Path, help="plot an existing results JSON to a PNG beside it")
    parser.add_argument("--only", default="",
                        help=f"comma-separated sections to run (default all): {','.join(SECTIONS)}")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="decode_fp8: pad block tables to this many tokens' blocks, as the runtime's CUDA graphs "
                             "pad them to max_blocks_per_seq (the plan reads the width); 0 = as wide as the context")
    parser.add_argument("--fp8-sweep", action="store_true",
                        help="decode_fp8: also time the FP8 pool under tilings around its plan (~1 min on a GPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="run decode_fp8 at tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the code)")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if args.smoke:
        # Triton picks interpreting or compiling when a kernel is decorated: before the kernel modules are imported.
        assert "trtopt.plugins.paged_attention.attention" not in sys.modules, "kernels imported before --smoke"
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        sections = sections_to_run(args.only or "decode_fp8", args.skip)
        if sections != ["decode_fp8"]:
            sys.exit(f"--smoke runs decode_fp8 only (the other sections need CUDA); got {sections}")
    elif not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU; use --smoke to check decode_fp8 on the CPU, --plot to draw results")
    else:
        device = torch.device("cuda")
        sections = sections_to_run(args.only, args.skip)
    warnings.filterwarnings("ignore", message=".*(not used because|runtime disabled|require query, key and value).*")
    results = {"env": environment(device)}
    results["copy_tbs"] = copy_bandwidth_tbs(device)
    print(f"{results['env']}\ncopy bandwidth {results['copy_tbs']:.2f} TB/s; sections {', '.join(sections)}",
          flush=True)
    if "prefill" in sections:
        results["prefill"] = bench_prefill()
    if "decode" in sections:
        results["decode"] = bench_decode(results["copy_tbs"])
    if "decode_fp8" in sections:
        results["decode_fp8"] = bench_decode_fp8(
            results["copy_tbs"], device=device, max_model_len=args.max_model_len, sweep=args.fp8_sweep,
            **(dict(shapes=SMOKE_DECODE_SHAPES, dtype=torch.float32) if args.smoke else {}))
    if "paged_prefill" in sections:
        results["paged_prefill"] = bench_paged_prefill()
    if "copy_blocks" in sections:
        results["copy_blocks"] = bench_copy_blocks(results["copy_tbs"])
        print(f"copy_blocks: {results['copy_blocks']}")
    if args.smoke and not args.out:
        return  # nothing to keep: the smoke run's numbers are the interpreter's
    out = args.out or Path("docs/benchmarks") / f"attention_{results['env']['gpu'].replace(' ', '_').lower()}.json"
    write_results(out, results, sections)
    from gpu_e2e import device_tag

    fp8_kv = out.parent / f"fp8_kv_{device_tag(results['env']['gpu'])}.json"  # issue 33's results file, where a run of fp8_kv.py made it
    if "decode_fp8" in sections and not args.smoke and fp8_kv.is_file():
        merge_fp8_kv_speedups(fp8_kv, results["decode_fp8"])
        print(f"updated {fp8_kv}: decode_speedup_vs_bf16.attention_per_shape")


if __name__ == "__main__":
    main()
