"""Attention kernel benchmark: trtopt's Triton kernels vs torch SDPA baselines measured in the same run.

    python benchmarks/bench_attention.py --out docs/benchmarks/attention_<gpu>.json   # on a CUDA machine
    python benchmarks/bench_attention.py --plot docs/benchmarks/attention_<gpu>.json  # anywhere with matplotlib

Prefill: FlashAttention TFLOP/s (causal FLOPs halved, the FA papers' convention) vs SDPA's cuDNN and flash backends.
Decode: PagedAttention over a randomly permuted block pool vs SDPA over the same keys in a contiguous cache,
reported as TB/s of KV read, next to the device-to-device copy bandwidth measured in the same run. Each kernel's
output is also checked against the baseline before it is timed, so a fast wrong kernel cannot post a number.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
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
BLOCK_SIZE = 16


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def bench_graph_ms(fn) -> float:
    """Time fn as a replayed CUDA graph: what the runtime's decode path does, with no host launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
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


def make_paged_decode(B: int, Hq: int, Hkv: int, L: int, D: int, dtype=torch.bfloat16):
    """A decode step over a permuted pool, plus the same keys as a contiguous [B, Hkv, L, D] cache."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-L // BLOCK_SIZE)
    num_blocks = B * blocks_per_seq + 1  # + the null block 0
    pool = torch.randn(num_blocks, 2, Hkv, BLOCK_SIZE, D, device="cuda", dtype=dtype, generator=gen)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).to(torch.int32)
    tables = tables.view(B, blocks_per_seq).contiguous()
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    last = L - 1
    slots = (tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE).contiguous()
    q = torch.randn(1, Hq, B, D, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1, Hkv, B, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, Hkv, B, D, device="cuda", dtype=dtype, generator=gen)
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


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": platform.python_version()}


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = ["triton", "sdpa_cudnn", "sdpa_flash"]
    width = 0.27
    for i, name in enumerate(names):
        vals = [r.get(name, {}).get("tflops", 0.0) for r in data["prefill"]]
        ax1.bar([x + (i - 1) * width for x in range(len(vals))], vals, width, label=name)
    ax1.set_xticks(range(len(data["prefill"])), [r["shape"] for r in data["prefill"]], fontsize=8)
    ax1.set_ylabel("TFLOP/s (causal, bf16)")
    ax1.set_title("Prefill: FlashAttention kernel vs SDPA")
    ax1.legend()
    # Backends that took none of the shapes (SDPA's efficient kernel rejects GQA decode) are left out.
    names = [n for n in ("triton", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
             if any("tbs" in r.get(n, {}) for r in data["decode"])]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [r.get(name, {}).get("tbs", 0.0) for r in data["decode"]]
        ax2.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(vals))], vals, width, label=name)
    ax2.axhline(data["copy_tbs"], color="k", linestyle="--", label="D2D copy (read+write)")
    ax2.set_xticks(range(len(data["decode"])), [r["shape"] for r in data["decode"]], fontsize=7)
    ax2.set_ylabel("TB/s of KV read")
    ax2.set_title("Decode: PagedAttention (paged pool) vs SDPA (contiguous)")
    ax2.set_ylim(0, data["copy_tbs"] * 1.25)
    ax2.legend(fontsize=8, loc="upper center", ncol=4)
    fig.suptitle(f"{data['env']['gpu']} · torch {data['env']['torch']} · triton {data['env']['triton']} · "
                 f"{data['env']['date']}", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON results (needs CUDA)")
    parser.add_argument("--plot", type=Path, help="plot an existing results JSON to a PNG beside it")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: prefill,decode,paged_prefill")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU; use --plot to draw existing results")
    skip = set(filter(None, args.skip.split(",")))
    warnings.filterwarnings("ignore", message=".*(not used because|runtime disabled|require query, key and value).*")
    results = {"env": environment()}
    results["copy_tbs"] = copy_bandwidth_tbs()
    print(f"{results['env']}\ncopy bandwidth {results['copy_tbs']:.2f} TB/s", flush=True)
    results["prefill"] = [] if "prefill" in skip else bench_prefill()
    results["decode"] = [] if "decode" in skip else bench_decode(results["copy_tbs"])
    results["paged_prefill"] = [] if "paged_prefill" in skip else bench_paged_prefill()
    results["copy_blocks"] = bench_copy_blocks(results["copy_tbs"])
    print(f"copy_blocks: {results['copy_blocks']}")
    out = args.out or Path("docs/benchmarks") / f"attention_{results['env']['gpu'].replace(' ', '_').lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
