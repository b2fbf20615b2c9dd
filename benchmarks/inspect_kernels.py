"""What the compiler made of the attention kernels, and where a decode step's time goes.

    python benchmarks/inspect_kernels.py                 # CUDA: compiled specialisations, then a profile
    python benchmarks/inspect_kernels.py --offline-fp8   # no GPU: the FP8 paged decode kernel's resources on sm_90
    python benchmarks/inspect_kernels.py --loop-mix [TILE_N SEGMENTS STAGES WARPS]
                                                         # no GPU: its key loops' SASS instruction mix, bf16 vs FP8

For each compiled specialisation: registers, spills, shared memory, and whether the matmuls became Hopper
wgmma (PTX `wgmma.mma_async`) or the older mma.sync, and how wide the global loads are. Then a profiler
breakdown of one paged decode step (KV write, attention, segment merge) per kernel.

--offline-fp8 compiles the paged attention kernel over an FP8 pool (bf16 q, Llama-8B's heads 32/8 x 128, block size
16) at the decode tilings the planner picks, for sm_90 with this machine's Triton, and runs the ptxas Triton
bundles on each PTX: registers and spill bytes a thread, shared memory a program, and the PTX's byte-wide global
loads and cp.async copies. Registers bound how many programs of 128 threads share a multiprocessor
(65,536 / (128 x regs)). Run it under the GPU image's Triton (3.6 on the project's H200s) to see what the GPU runs:
`pip install --target DIR triton==3.6.0` and PYTHONPATH=DIR.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
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


# (tile_n, num_segments, num_stages) of the FP8 decode plans (planning.py plan_paged_launch(kv_bytes=1)) and the
# 64-key tiles the sweeps compare them with
FP8_DECODE_TILINGS = ((128, 1, 3), (128, 2, 3), (128, 32, 3), (64, 16, 3), (64, 64, 3))


def _compile_offline(tile_n: int, segments: int, stages: int, *, fp8: bool = True, warps: int = 4):
    """`_paged_attn_kernel` compiled for sm_90 without a GPU (bf16 q, heads 32/8 x 128, block 16), over an FP8 pool
    or a bf16 one. Unit strides are constexpr 1 and the other strides and pointers divisible by 16, as a launch
    specialises them (otherwise every load is scalar and the PTX misleads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trtopt.plugins.paged_attention import attention

    fn = attention._paged_attn_kernel
    params = list(fn.arg_names)
    runtime = dict(Q="*bf16", Cache="*fp8e4nv" if fp8 else "*bf16", BlockTables="*i32", SeqLens="*i32",
                   QueryStartLoc="*i32", Alibi="*bf16", Out="*bf16", PartAcc="*fp32", PartMax="*fp32",
                   PartSum="*fp32", Counters="*i32", qk_scale="fp32", k_scale="fp32", v_scale="fp32",
                   num_seqs="i32", sliding_window="i32", stride_qh="i32", stride_qt="i32",
                   stride_cb="i32", stride_ckv="i32", stride_ch="i32", stride_co="i32", stride_bt="i32",
                   stride_oh="i32", stride_ot="i32")
    aligned = {n for n, t in runtime.items() if t.startswith("*") or n.startswith("stride_")}
    constexprs = dict(stride_qd=1, stride_cd=1, stride_od=1, GROUP=4, GROUP_PAD=4, BLOCK_Q=4, HEAD_DIM=128,
                      BLOCK_D=128, BLOCK_SIZE=16, TILE_N=tile_n, NUM_SEGMENTS=segments, IS_CAUSAL=True,
                      HAS_ALIBI=False, HAS_WINDOW=False, DOT_PRECISION="tf32",
                      MERGE=1 < segments <= attention.FUSED_MERGE_MAX_SEGMENTS, FP8_KV=fp8)
    signature = {p: runtime.get(p, "constexpr") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in aligned}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _ptxas(ptx: str, tmp: str, *, disassemble: bool = False) -> tuple[str, str]:
    """(ptxas -v log, SASS or "") of `ptx` through the ptxas and nvdisasm Triton bundles."""
    import os
    import subprocess

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    Path(path).write_text(ptx)
    done = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", path, "-o", cubin],
                          capture_output=True, text=True)
    if done.returncode != 0:  # e.g. a Triton whose PTX ISA is newer than the ptxas it bundles (3.9 here)
        raise SystemExit(f"ptxas refused Triton {triton.__version__}'s PTX: {done.stderr.strip()[-300:]}")
    return done.stderr, nvdisasm(cubin) if disassemble else ""


def nvdisasm(cubin: str) -> str:
    """The SASS listing of a cubin file, through the nvdisasm Triton bundles."""
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return subprocess.run([str(tool), "-c", cubin], capture_output=True, text=True, check=True).stdout


def offline_fp8_resources(tilings=FP8_DECODE_TILINGS) -> list[dict]:
    """Each tiling's FP8 decode kernel for sm_90 (`_compile_offline`), through the bundled ptxas: one dict of
    resources per tiling."""
    import tempfile

    rows = []
    for tile_n, segments, stages in tilings:
        compiled = _compile_offline(tile_n, segments, stages)
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            log, _ = _ptxas(ptx, tmp)
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
        rows.append(dict(tile_n=tile_n, num_segments=segments, num_stages=stages, registers=regs, spill_bytes=spill,
                         shared_bytes=compiled.metadata.shared, programs_per_sm_by_registers=65536 // (128 * regs),
                         byte_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.[bu]8\b", ptx)),
                         cp_async=ptx.count("cp.async")))
    return rows


def sass_loops(sass: str) -> list[tuple[int, Counter]]:
    """Each loop of a SASS listing (a label and the backward branch to it), innermost first as listed: its
    instruction count and opcodes (without modifiers) by count."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = Counter(m2.group(1).split(".")[0] for body in lines[labels[m.group(1)]:i + 1]
                          if (m2 := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", body)))
            loops.append((sum(ops.values()), ops))
    return loops


def loop_mix(tile_n: int = 128, segments: int = 1, stages: int = 3, warps: int = 4) -> None:
    """The SASS instruction mix of the decode kernel's key loops, bf16 pool against FP8 pool, at one tiling: what
    each warp issues per key tile (docs/benchmarks/NOTES.md: what the count did and did not predict of the speed)."""
    import tempfile

    for fp8 in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            compiled = _compile_offline(tile_n, segments, stages, fp8=fp8, warps=warps)
            log, sass = _ptxas(compiled.asm["ptx"], tmp, disassemble=True)
        regs = re.search(r"Used (\d+) registers", log).group(1)
        print(f"{'FP8' if fp8 else 'bf16'} pool, tile_n={tile_n} num_segments={segments} num_stages={stages} "
              f"num_warps={warps}: {regs} registers, {compiled.metadata.shared} B shared")
        for count, ops in sass_loops(sass):
            if count > 100:  # the key loops (unmasked, then masked), not the prologue's small ones
                print(f"  loop of {count} instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))


if __name__ == "__main__":
    if "--offline-fp8" in sys.argv[1:]:
        import triton

        print(f"FP8 paged decode kernel on sm_90, Triton {triton.__version__} (bf16 q, heads 32/8 x 128, block 16)")
        for row in offline_fp8_resources():
            print("  " + " ".join(f"{k}={v}" for k, v in row.items()))
    elif "--loop-mix" in sys.argv[1:]:  # optional: tile_n num_segments num_stages num_warps
        loop_mix(*(int(a) for a in sys.argv[sys.argv.index("--loop-mix") + 1:]))
    else:
        main()
