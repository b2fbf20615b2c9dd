"""Host cost of one eager PagedAttention call (issue 11: target <= 20 us per call), and of its pieces.

Each figure is host wall time per call over many back-to-back calls with no synchronisation inside the loop; the
decode step is tiny (one token, 64 cached tokens), so the GPU keeps up and the loop measures the host. On a machine
without CUDA only the pure-Python pieces (input checks, launch planning) are timed.

    python3 benchmarks/bench_launch_host.py            # CUDA if present
    python3 benchmarks/bench_launch_host.py --out x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, n: int, device: torch.device) -> float:
    for _ in range(50):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from trtopt.plugins.paged_attention import kernel as pk
    from trtopt.runtime.executors import trtopt_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hq, hkv, d, bs, blocks, width = 32, 8, 64, 16, 64, 128
    q = torch.randn(1, hq, 1, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, 1, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cache = torch.randn(blocks, 2, hkv, bs, d, device=device, dtype=torch.bfloat16)
    tables = torch.zeros(1, width, dtype=torch.int32, device=device)
    tables[0, :4] = torch.tensor([5, 9, 2, 7])
    seq_lens = torch.tensor([64], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    slots = torch.tensor([7 * bs + 15], dtype=torch.int64, device=device)
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d ** -0.5)
    rows = {
        "check_inputs": lambda: pk._check_paged_inputs(q, k, v, cache, tables, seq_lens, qsl, slots, hq, hkv, d, None),
        "plan_launch_uncached": lambda: pk.plan_paged_launch.__wrapped__(1, 1, hkv, hq // hkv, width * bs, 132),
        "plan_launch_cached": lambda: pk.plan_paged_launch(1, 1, hkv, hq // hkv, width * bs, 132),
    }
    if device.type == "cuda":
        rows["write_kv_launch"] = lambda: pk.write_kv_triton(k, v, cache, slots)
        rows["paged_attention_call"] = lambda: trtopt_ops.paged_attention(q, k, v, cache, tables, seq_lens, qsl,
                                                                          slots, **attrs)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "n": args.n}
    for name, fn in rows.items():
        result[f"{name}_us"] = per_call_us(fn, args.n, device)
        print(f"{name:<24} {result[f'{name}_us']:8.2f} us/call")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
