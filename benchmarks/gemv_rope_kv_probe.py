"""Probe of the Q/K/V GEMV with RoPE and the KV write as its epilogue (runtime/kernels/gemv_triton.py `gemv_rope_kv`,
issue 11 session 14), used to choose its default config.

1. Fidelity: the fused kernel against the plain GEMV followed by PagedAttention's RoPE + KV-write kernel, over shapes
   and dtypes: max abs difference of q, of the pool and of v, and whether q and the pool are bit-equal.
2. Speed: the 1.24B plan's Q/K/V (bf16, 32/8 heads of 64, K = 2048) as 20 back-to-back calls replayed from a CUDA
   graph, per call: the plain GEMV, the plain GEMV + RoPE/KV write, the fused kernel at several (pairs per program,
   BLOCK_K, warps) configs, and the default config with FMA contraction on.

Its H200 output is docs/benchmarks/logs/gemv_rope_kv_probe_h200.log (a log, not a JSON: the end-to-end effect is
gpu_e2e.py's `without_gemv_rope_kv` row).

    python3 benchmarks/gemv_rope_kv_probe.py     # needs a CUDA GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtopt.plugins.paged_attention.kernel import rope_write_kv_triton  # noqa: E402
from trtopt.runtime.kernels import gemv_triton  # noqa: E402

DEV = torch.device("cuda")
SHAPES = [(4, 2, 16, 64, None), (4, 2, 16, 100, (2, 32, 1)), (32, 8, 64, 2048, None), (9, 3, 64, 576, None)]
CONFIGS = [None, (1, 2048, 4), (1, 2048, 2), (2, 2048, 8), (1, 1024, 4)]


def case(hq: int, hkv: int, d: int, k: int, dtype: torch.dtype, blocks: int = 5, block_size: int = 4):
    n = (hq + 2 * hkv) * d
    x = torch.randn(1, k).to(DEV, dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(DEV, dtype)
    cos, sin = (torch.randn(1, 1, d).to(DEV, dtype) for _ in range(2))
    pool = torch.zeros(blocks, 2, hkv, block_size, d, dtype=dtype, device=DEV)
    return x, w, cos, sin, pool, torch.tensor([9], device=DEV)


def unfused(x, w, cos, sin, pool, slot, hq, hkv, d, config=None):
    """The plain GEMV, then the RoPE + KV-write kernel: (rotated q [1, Hq, 1, D], the GEMV's output)."""
    y = gemv_triton.gemv(x, w, config)
    q, k, v = (part.reshape(1, 1, h, d).transpose(1, 2)
               for part, h in zip(y.split([hq * d, hkv * d, hkv * d], -1), (hq, hkv, hkv)))
    return rope_write_kv_triton(q, k, v, cos, sin, pool, slot), y


def fidelity() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hq, hkv, d, k, cfg in SHAPES:
            x, w, cos, sin, pool, slot = case(hq, hkv, d, k, dtype)
            want_pool = pool.clone()
            y = gemv_triton.gemv_rope_kv(x, w, cos, sin, pool, slot, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                         config=cfg)
            q_rot, plain = unfused(x, w, cos, sin, want_pool, slot, hq, hkv, d,
                                   None if cfg is None else (2, cfg[1], cfg[2]))
            got_q = y[:, :hq * d].reshape(1, 1, hq, d).transpose(1, 2)
            exact = x.float() @ w.float().t()
            v_at = (hq + hkv) * d
            print(dtype, hq, hkv, d, k, cfg,
                  "q", (got_q.float() - q_rot.float()).abs().max().item(),
                  "pool", (pool.float() - want_pool.float()).abs().max().item(),
                  "v", (y[:, v_at:].float() - plain[:, v_at:].float()).abs().max().item(),
                  "gemv-vs-fp32", (plain.float() - exact).abs().max().item(),
                  "eq", torch.equal(pool, want_pool), torch.equal(got_q, q_rot))


def per_call_us(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300) * 1000 / calls


def speed() -> None:
    hq, hkv, d, k = 32, 8, 64, 2048
    x, w, cos, sin, _, slot = case(hq, hkv, d, k, torch.bfloat16)
    pool = torch.zeros(64, 2, hkv, 16, d, dtype=torch.bfloat16, device=DEV)
    rows = [("gemv", lambda: gemv_triton.gemv(x, w)),
            ("gemv+rope_write_kv", lambda: unfused(x, w, cos, sin, pool, slot, hq, hkv, d))]
    for cfg in CONFIGS:
        rows.append((f"gemv_rope_kv {cfg}", lambda cfg=cfg: gemv_triton.gemv_rope_kv(
            x, w, cos, sin, pool, slot, num_heads=hq, num_kv_heads=hkv, head_dim=d, config=cfg)))

    def contracted():
        from unittest import mock

        with mock.patch.object(gemv_triton, "no_fp_fusion", lambda: {}):  # the kernel compiled with FMA contraction
            return gemv_triton.gemv_rope_kv(x, w, cos, sin, pool, slot, num_heads=hq, num_kv_heads=hkv, head_dim=d)

    rows.append(("gemv_rope_kv fp-fusion-on", contracted))
    for name, fn in rows:
        print(name, "us per call (graph of 20)", per_call_us(fn))


if __name__ == "__main__":
    torch.manual_seed(0)
    fidelity()
    speed()
