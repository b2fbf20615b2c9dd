"""What the compiler made of the attention kernels, and where a decode step's time goes (CUDA only).

    python benchmarks/inspect_kernels.py

For each compiled specialisation: registers, spills, shared memory, and whether the matmuls became Hopper
wgmma (PTX `wgmma.mma_async`) or the older mma.sync, and how wide the global loads are. Then a profiler
breakdown of one paged decode step (KV write, attention, segment merge) per kernel.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def describe(kernel) -> None:
    ptx = kernel.asm.get("ptx", "")
    loads = re.findall(r"(ld\.global(?:\.\w+)*?\.v(\d))", ptx)
    widths = sorted({int(w) for _, w in loads})
    print(f"  {kernel.name}: regs={kernel.n_regs} spills={kernel.n_spills} shared={kernel.metadata.shared} "
          f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')} cp.async={ptx.count('cp.async')} "
          f"tma={ptx.count('cp.async.bulk.tensor')} vector-load widths={widths}")


def compiled(jit_fn):
    from triton.runtime.autotuner import Autotuner

    fn = jit_fn.fn if isinstance(jit_fn, Autotuner) else jit_fn  # a JITFunction's own .fn is the Python function
    for per_device in fn.device_caches.values():
        yield from per_device[0].values()


def main() -> None:
    from trtopt.plugins.flash_attention import kernel as fa
    from trtopt.plugins.paged_attention import attention, write_kv
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import make_paged_decode

    q, k, v = (torch.randn(4, 32, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fa.flash_attention_triton(q, k, v, num_heads=32, num_kv_heads=32, head_dim=128, scale=128**-0.5, causal=1)
    print("flash attention (best config:", fa._flash_fwd_kernel.best_config, ")")
    for kern in compiled(fa._flash_fwd_kernel):
        describe(kern)

    attrs = dict(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5, state=PagedLaunchState())
    for B, L in ((64, 4096), (1, 32768)):
        step = make_paged_decode(B, 32, 8, L, 128)
        for _ in range(3):
            paged_attention_triton(**step, **attrs)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                paged_attention_triton(**step, **attrs)
            torch.cuda.synchronize()
        print(f"paged decode B{B} L{L}: per-kernel CUDA time (20 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
    print("paged attention kernels")
    for kern in compiled(attention._paged_attn_kernel):
        describe(kern)
    for kern in compiled(write_kv._write_kv_kernel):
        describe(kern)


if __name__ == "__main__":
    main()
