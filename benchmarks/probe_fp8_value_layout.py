"""Probe (GPU): what limits PagedAttention's decode over an FP8 pool, timed against the bf16 pool in the same run.

    python benchmarks/probe_fp8_value_layout.py --out docs/benchmarks/probe_fp8_value_layout_h200.json

The FP8 read of attention.py is 1.2-1.4× the bf16 read at the three decode shapes of bench_attention.py, against
issue #33's 1.7×. Its sm_90 PTX points at the value tiles: tl.dot(p, v.to(fp16)) needs v transposed (the reduction
runs over keys, and a pool row is one key's D values), and for 8-bit data Triton gathers that transpose from
shared memory one byte per load (`ld.shared.b8`, 128 a thread per 128-key tile), where a 16-bit tile takes
`ldmatrix.trans`. This probe times three ways of reading the value tiles, each a variant of the current kernel made
by replacing its value load in the source (edge tiles read the null block 0 past the sequence's keys, as the
kernel's masked loads do):

- "bytes": the kernel as it is;
- "words": v loaded as 32-bit words and widened to fp16 in registers by PTX (cvt.rn.f16x2.e4m3x2), so the
  transpose is a 16-bit `ldmatrix.trans` (what Triton 3.9 compiles it to; the GPU image's 3.6 moves the words
  through shared memory twice);
- "vt3": timing only, its values are wrong for this pool: each block's value half read as if it were stored
  transposed, [D, block_size] (vLLM's value-cache layout), so a value tile loads and converts as a key tile does.

Each variant under 64- and 128-key tiles and 2-3 pipeline stages, replayed from CUDA graphs; the segments are the
FP8 plan's. A launch given is not planned, so split-KV merges in a second launch here (the planned calls merge in
the attention launch), for bf16 as for FP8.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_attention as B  # noqa: E402

UNMASKED_V_LOAD = """        if MASKED or BLOCK_D != HEAD_DIM:
            v = tl.load(kv_ptr + stride_ckv, mask=kv_mask, other=0.0)  # v: [TILE_N, BLOCK_D]
"""
WORDS = """        if FP8_KV and BLOCK_D == HEAD_DIM:
            rows = (block * stride_cb + stride_ckv + (n0 % BLOCK_SIZE + offs_t % BLOCK_SIZE) * stride_co) // 4
            rows = tl.multiple_of(rows, 4)
            words = tl.load(k_head.to(tl.pointer_type(tl.int32)) + rows[:, None] + tl.arange(0, BLOCK_D // 4)[None, :],
                            mask=k_ok[:, None], other=0)
            e0, e1, e2, e3 = tl.inline_asm_elementwise(
                asm="{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
                    "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
                constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
            v = tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (TILE_N, BLOCK_D))
        el"""
VT3 = """        if FP8_KV and BLOCK_D == HEAD_DIM:
            first = n0 + tl.arange(0, TILE_N // BLOCK_SIZE) * BLOCK_SIZE  # each block's first key of the tile
            blocks = tl.load(table + first // BLOCK_SIZE, mask=first < key_end, other=0).to(tl.int64)
            vt = tl.load(k_head + stride_ckv + (blocks * stride_cb)[:, None, None]
                         + (offs_d * BLOCK_SIZE)[None, :, None] + tl.arange(0, BLOCK_SIZE)[None, None, :])
            v = tl.reshape(tl.permute(vt, (0, 2, 1)), (TILE_N, BLOCK_D))
        el"""


def variant(name: str, replacement: str):
    """The attention module with its value load replaced, imported from a temporary file."""
    from trtopt.plugins.paged_attention import attention

    source = inspect.getsource(attention)
    assert source.count(UNMASKED_V_LOAD) == 1, "attention.py's value load changed: update this probe"
    path = Path(tempfile.mkdtemp()) / f"attention_{name}.py"
    path.write_text(source.replace(UNMASKED_V_LOAD, replacement + UNMASKED_V_LOAD.lstrip()))
    spec = importlib.util.spec_from_file_location(f"attention_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from trtopt.plugins.paged_attention import attention
    from trtopt.plugins.paged_attention.planning import PagedLaunchState, _device_sm_count, plan_paged_launch

    device = torch.device("cuda")
    modules = {"bytes": attention, "words": variant("words", WORDS), "vt3": variant("vt3", VT3)}
    results = {"env": B.environment(device), "copy_tbs": B.copy_bandwidth_tbs(device), "rows": []}
    for b, hq, hkv, L, D in B.DECODE_SHAPES:
        step = B.make_paged_decode(b, hq, hkv, L, D, torch.bfloat16, device=device)
        attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=D, scale=D**-0.5)
        k_scale, v_scale = B.amax_scales(step["kv_cache"])
        fp8 = {**step, "kv_cache": B.fp8_pool(step["kv_cache"], k_scale, v_scale)}
        plan = plan_paged_launch(b, b, hkv, hq // hkv, L, _device_sm_count(device), kv_bytes=1)
        row = {"shape": f"B{b}·Hq{hq}·Hkv{hkv}·L{L}·D{D}", "fp8_plan": plan.__dict__, "cells": []}
        for name, launch in (("bf16_planned", None), ("bf16_fp8_plan", plan)):
            call = functools.partial(attention.paged_attention_triton, **step, **attrs, launch=launch,
                                     **({} if launch else dict(state=PagedLaunchState())))
            call()
            row[f"{name}_ms"] = B.bench_graph_ms(call)
        reference, _ = attention.paged_attention_triton(**fp8, **attrs, k_scale=k_scale, v_scale=v_scale)
        for (name, module), tile_n, stages in ((m, t, s) for m in modules.items() for t in (64, 128) for s in (2, 3)):
            launch = dataclasses.replace(plan, tile_n=tile_n, num_stages=stages)
            call = functools.partial(module.paged_attention_triton, **fp8, **attrs, k_scale=k_scale,
                                     v_scale=v_scale, launch=launch)
            got, _ = call()
            ms = B.bench_graph_ms(call)
            diff = float((got.float() - reference.float()).abs().max() / reference.float().abs().max())
            cell = {"path": name, "tile_n": tile_n, "num_stages": stages, "ms": ms,
                    "tbs": 2 * b * hkv * L * D / ms / 1e9, "speedup_vs_bf16": row["bf16_planned_ms"] / ms,
                    "rel_diff_vs_bytes_planned": diff}
            row["cells"].append(cell)
            print(f"{row['shape']} {name:5} tile {tile_n:3} stages {stages}: {ms * 1e3:6.1f} µs, "
                  f"{cell['speedup_vs_bf16']:.2f}× bf16, diff {diff:.2g}", flush=True)
        for name in modules:
            best = min((c for c in row["cells"] if c["path"] == name), key=lambda c: c["ms"])
            row[f"best_{name}"] = best
        print(f"{row['shape']}: bf16 {row['bf16_planned_ms'] * 1e3:.1f} µs planned, "
              f"{row['bf16_fp8_plan_ms'] * 1e3:.1f} µs at the FP8 plan; best "
              + ", ".join(f"{n} {row[f'best_{n}']['speedup_vs_bf16']:.2f}×" for n in modules), flush=True)
        results["rows"].append(row)
        del step, fp8
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
