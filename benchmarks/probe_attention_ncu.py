"""One planned decode PagedAttention call with a bf16 pool, then the same call with the pool in FP8, at one of
bench_attention.py's decode shapes: the two launches an `ncu` run profiles side by side (issue 33: why the FP8 kernel
streams 3.1 TB/s where bf16 streams 4.1 at B64·L4096, docs/benchmarks/NOTES.md).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis -k regex:_paged_attn --csv --page details \\
        python benchmarks/probe_attention_ncu.py --shape 64 32 8 4096 128 > ncu.csv

Each pool is called twice (the first call compiles); profile with --launch-skip 1 --launch-count 1 per pool, or
take every launch and read the second of each. --smoke runs a tiny shape on the CPU (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import amax_scales, make_paged_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=5, default=[64, 32, 8, 4096, 128], metavar=("B", "HQ", "HKV", "L", "D"))
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU under the Triton interpreter")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.shape, device, dtype = [2, 4, 2, 64, 32], torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton
    from trtopt.plugins.paged_attention.reference import quantized_pool

    B, Hq, Hkv, L, D = args.shape
    step = make_paged_decode(B, Hq, Hkv, L, D, dtype, device=device)
    attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5)
    k_scale, v_scale = amax_scales(step["kv_cache"])
    paged = functools.partial(paged_attention_triton, state=PagedLaunchState())
    fp8 = {**step, "kv_cache": quantized_pool(step["kv_cache"], k_scale, v_scale)}
    for name, s, scales in (("base", step, {}), ("fp8", fp8, dict(k_scale=k_scale, v_scale=v_scale))):
        for _ in range(2):
            out, _ = paged(**s, **attrs, **scales)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{name}: pool {s['kv_cache'].dtype}, out {tuple(out.shape)}, finite {bool(out.isfinite().all())}",
              flush=True)


if __name__ == "__main__":
    main()
