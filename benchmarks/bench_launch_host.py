"""Host cost of one eager PagedAttention call (issue 11: target <= 20 us per call), and of its pieces.

Each figure is host wall time per call over many back-to-back calls with no synchronisation inside the loop; the
decode step is tiny (one token, 64 cached tokens), so the GPU keeps up and the loop measures the host. On a machine
without CUDA only the pure-Python pieces (input checks, launch planning) are timed.

On CUDA the call is also taken apart: each Triton launch it makes is timed through Triton's dispatcher and straight
through the CompiledKernel the dispatcher returned, and `direct_output_equal` checks that the direct launches write
the same output and pool. Also timed: the fused RoPE + KV-write launch and the call the engine makes with it, the
greedy argmax (torch's vs the two-launch kernel), and one Add+RMSNorm and one SiLU·mul launch.

Every kernel call of trtopt goes through plugins/launcher.py (session 9), which launches the kept CompiledKernel
itself after the first launch of a specialisation; PagedAttention is planned once per step shape and launched per
layer through the CUDA driver (attention.py `_PagedPlan`, launcher.DriverLaunch; session 10), with a
PagedLaunchState of this script's own, as the executor owns one. Each PagedAttention and KV-write row is timed both
ways in the same run: `<row>_us` as the engine runs it, `<row>_dispatcher_us` with that state's
`launcher.dispatcher_only = True` (every launch through Triton's dispatcher and no plan: what the engine paid before
session 9). The other kernels launch as TRTOPT_TRITON_DISPATCH said at import: run the script with it set to 1 for
their dispatcher rows (every `<row>_us` is then the dispatcher's). The `*_layers_call` rows are an eager step's calls: 16 layers, each with its own q/k/v and pool,
sharing the step's metadata, whose tensors are new each step (two sets alternate); per call. The `*_nosplit_*` rows
pass an 8-block table (what an eager step of a 64-token sequence passes): no split-KV merge, two launches a call.
The `*_written_*` rows (session 14) are the call a batch-1 decode step makes since the Q/K/V GEMV rotates q and k and
writes the pool itself (runtime/kernels/gemv_triton.py `gemv_rope_kv`; PagedAttention's `kv_written`): q, k and v are
views of the projection's output row, and the op launches the attention kernels only (one launch without the
split-KV merge).
`gemv_qkv_launch` / `gemv_rope_kv_launch` are the host costs of the plain and the fused Q/K/V GEMV launch.

    python3 benchmarks/bench_launch_host.py            # CUDA if present
    python3 benchmarks/bench_launch_host.py --out x.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


LAYERS = 16  # the eager-step rows: layers per step


def per_call_us(fn, n: int, device: torch.device, repeats: int = 5) -> float:
    """Host µs per call: the fastest of `repeats` loops of n // repeats calls (timeit's rule: the other loops
    measured the same code plus whatever else the machine did; on the lent GPU hosts that noise moved single-loop
    rows by up to 1.5x between runs in session 10)."""
    for _ in range(50):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    calls = max(1, n // repeats)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return best / calls * 1e6


def record_launches(call) -> list[tuple]:
    """(JITFunction, grid, args, kwargs) of every Triton launch that ``call`` makes, in order (call runs once)."""
    launches = []
    original = triton.runtime.jit.JITFunction.run

    def recording(self, *a, grid, warmup, **kw):
        launches.append((self, grid, a, kw))
        return original(self, *a, grid=grid, warmup=warmup, **kw)

    triton.runtime.jit.JITFunction.run = recording
    try:
        call()
    finally:
        triton.runtime.jit.JITFunction.run = original
    torch.cuda.synchronize()
    return launches


def direct_runner(fn, grid, call_args, kwargs):
    """A launch of fn's CompiledKernel for exactly these arguments, bypassing the dispatcher: every kernel
    parameter (constexprs included) in signature order, as JITFunction.run passes them to CompiledKernel.run."""
    compiled = fn[grid](*call_args, **kwargs)  # the dispatcher returns the kernel it launched
    bound = inspect.signature(fn.fn).bind(*call_args, **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    values = list(bound.arguments.values())
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    runner = compiled[grid3]
    runner(*values)
    torch.cuda.synchronize()
    return lambda: runner(*values)


def direct_output_equal(launches, q, k, v, cache, tables, seq_lens, qsl, slots, attrs) -> bool | None:
    """The same call replayed through the compiled kernels writes the same attention output (and pool)."""
    from trtopt.runtime.executors import trtopt_ops

    try:
        runners = [direct_runner(fn, g, a, kw) for fn, g, a, kw in launches]
    except Exception:
        return None
    pool = cache.clone()
    want, _ = trtopt_ops.paged_attention(q, k, v, pool, tables, seq_lens, qsl, slots, **attrs)
    want, want_pool = want.clone(), pool.clone()
    # The recorded launches write the buffers they were recorded with (cache and the call's own output).
    out = next(a for fn, g, a, kw in launches if fn.fn.__name__ == "_paged_attn_kernel")[6]
    out.zero_()
    for run in runners:
        run()
    torch.cuda.synchronize()
    return bool(torch.equal(out, want) and torch.equal(cache, want_pool))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from trtopt.plugins import launcher
    from trtopt.plugins.paged_attention import attention, planning
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
    state = pk.PagedLaunchState()  # the plans, merge counters and launcher switch of every call here
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d ** -0.5, state=state)
    per_layer = {}  # rows whose callable makes LAYERS calls
    result_extra = {}
    rows = {
        "check_inputs": lambda: attention._check_paged_inputs(q, k, v, cache, tables, seq_lens, qsl, slots, hq, hkv,
                                                              d, None, state.metadata),
        "plan_launch_uncached": lambda: pk.plan_paged_launch.__wrapped__(1, 1, hkv, hq // hkv, width * bs, 132),
        "plan_launch_cached": lambda: pk.plan_paged_launch(1, 1, hkv, hq // hkv, width * bs, 132),
    }
    # The call the engine makes since session 7 (RoPE folded into the KV write): cos/sin of one position.
    angles = torch.arange(d // 2, device=device, dtype=torch.float32) * 0.01
    cos = torch.cat((angles.cos(), angles.cos()))[None, None, None].to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()))[None, None, None].to(torch.bfloat16)
    logits = torch.randn(1, 128256, device=device)
    if device.type == "cuda":
        from trtopt.runtime.kernels.argmax import greedy_argmax

        rows["write_kv_launch"] = lambda: pk.write_kv_triton(k, v, cache, slots, launcher=state.launcher)
        rows["rope_write_kv_launch"] = lambda: pk.rope_write_kv_triton(q, k, v, cos, sin, cache, slots,
                                                                       launcher=state.launcher)
        rows["paged_attention_call"] = lambda: trtopt_ops.paged_attention(q, k, v, cache, tables, seq_lens, qsl,
                                                                          slots, **attrs)
        rows["paged_attention_rope_call"] = lambda: trtopt_ops.paged_attention_rope(
            q, k, v, cache, tables, seq_lens, qsl, slots, rope_cos=cos, rope_sin=sin, rope_half=0, **attrs)
        # What an eager step does: 16 layers, each with its own q/k/v and pool, sharing the step's metadata; two
        # sets of metadata tensors alternate, as the engine makes new ones each step. Per call (per layer).
        layers = [tuple(torch.randn_like(x) for x in (q, k, v, cache)) for _ in range(LAYERS)]
        metadata = [tuple(x.clone() for x in (tables, seq_lens, qsl, slots)) for _ in range(2)]
        # The same step with an 8-block (128-key) table, what an eager engine step passes for a 64-token sequence
        # (its tables are as wide as its longest sequence): the tiling does not split the key range, so a call is
        # two launches (no split-KV merge), as in the 1.24B plan's eager batch-1 step (gpu_e2e.py's profile).
        narrow = [(tables[:, :8].clone(), *rest[1:]) for rest in metadata]

        # The call a batch-1 decode step makes since session 14: the Q/K/V GEMV rotated q and k and wrote the pool
        # (runtime/kernels/gemv_triton.py gemv_rope_kv), so q, k and v are views of its output row and the op
        # launches the attention kernels only (kv_written).
        def qkv_views():
            y = torch.randn(1, (hq + 2 * hkv) * d, device=device, dtype=torch.bfloat16)
            return [part.reshape(1, 1, h, d).transpose(1, 2)
                    for part, h in zip(y.split([hq * d, hkv * d, hkv * d], -1), (hq, hkv, hkv))]

        written = [(*qkv_views(), lc) for *_, lc in layers]

        def eager_step(rope: bool | str, metadata=metadata, steps=iter(range(10 ** 9))):
            meta = metadata[next(steps) % 2]
            if rope == "written":
                for lq, lk, lv, lc in written:
                    trtopt_ops.paged_attention_rope(lq, lk, lv, lc, *meta, rope_cos=cos, rope_sin=sin, rope_half=0,
                                                    kv_written=True, **attrs)
                return
            for lq, lk, lv, lc in layers:
                if rope:
                    trtopt_ops.paged_attention_rope(lq, lk, lv, lc, *meta, rope_cos=cos, rope_sin=sin, rope_half=0,
                                                    **attrs)
                else:
                    trtopt_ops.paged_attention(lq, lk, lv, lc, *meta, **attrs)

        per_layer["paged_attention_layers_call"] = lambda: eager_step(False)
        per_layer["paged_attention_rope_layers_call"] = lambda: eager_step(True)
        result_extra["split_segments"] = pk.plan_paged_launch(1, 1, hkv, hq // hkv, width * bs,
                                                              planning._device_sm_count(device)).num_segments
        result_extra["nosplit_segments"] = pk.plan_paged_launch(1, 1, hkv, hq // hkv, 8 * bs,
                                                                planning._device_sm_count(device)).num_segments
        per_layer["paged_attention_layers_nosplit_call"] = lambda: eager_step(False, narrow)
        per_layer["paged_attention_rope_layers_nosplit_call"] = lambda: eager_step(True, narrow)
        per_layer["paged_attention_written_layers_call"] = lambda: eager_step("written")
        per_layer["paged_attention_written_layers_nosplit_call"] = lambda: eager_step("written", narrow)
        # The Q/K/V GEMV of the 1.24B plan without and with RoPE + the KV write as its epilogue (one launch each).
        from trtopt.runtime.kernels import gemv_triton

        x_row = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
        w_qkv = torch.randn((hq + 2 * hkv) * d, 2048, device=device, dtype=torch.bfloat16)
        rows["gemv_qkv_launch"] = lambda: gemv_triton.gemv(x_row, w_qkv)
        rows["gemv_rope_kv_launch"] = lambda: gemv_triton.gemv_rope_kv(
            x_row, w_qkv, cos, sin, cache, slots, num_heads=hq, num_kv_heads=hkv, head_dim=d)
        # The sampler's greedy argmax (one 128K-vocabulary row): torch's one kernel vs the two Triton launches.
        rows["argmax_torch"] = lambda: logits.argmax(dim=-1)
        rows["argmax_triton"] = lambda: greedy_argmax(logits)
        from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_triton
        from trtopt.plugins.silu_mul.kernel import silu_mul_triton

        hidden = torch.randn(1, 1, 2048, device=device, dtype=torch.bfloat16)
        norm_scale = torch.ones(2048, device=device, dtype=torch.bfloat16)
        gate_up = torch.randn(1, 1, 16384, device=device, dtype=torch.bfloat16).split(8192, dim=-1)
        rows["add_rms_norm_launch"] = lambda: add_rms_norm_triton(hidden, hidden, norm_scale, epsilon=1e-5)
        rows["silu_mul_launch"] = lambda: silu_mul_triton(*gate_up)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "n": args.n, **result_extra}
    if device.type == "cuda":
        # Where the launcher's time goes: each Triton launch of one call, through Triton's dispatcher (binder,
        # specialisation key, cache lookup) and straight through the CompiledKernel it returned (what a launcher
        # that keeps its compiled kernels would pay), plus the partial buffers' allocation.
        state.launcher.dispatcher_only = True  # every launch through JITFunction.run, where record_launches sees it
        launches = record_launches(lambda: trtopt_ops.paged_attention(q, k, v, cache, tables, seq_lens, qsl, slots,
                                                                      **attrs))
        state.launcher.dispatcher_only = False
        for i, (fn, grid, call_args, kwargs) in enumerate(launches):
            name = f"launch{i}_{fn.fn.__name__.strip('_')}"
            rows[f"{name}_dispatch"] = lambda fn=fn, g=grid, a=call_args, kw=kwargs: fn[g](*a, **kw)
            try:
                rows[f"{name}_compiled"] = direct_runner(fn, grid, call_args, kwargs)
            except Exception as e:  # a Triton whose CompiledKernel runner differs: recorded, not fatal
                result[f"{name}_compiled_error"] = f"{type(e).__name__}: {e}"
        rows["empty_partials_x3"] = lambda: [torch.empty(4096, device=device) for _ in range(3)]
        # Where one planned call of the batch-1 decode path (kv_written, the 8-block table) spends its host time:
        # the plan key, the planned call alone, and the pieces of that call.
        lq, lk, lv, lc = written[0]
        meta = narrow[0]
        state.clear_plans()
        trtopt_ops.paged_attention_rope(lq, lk, lv, lc, *meta, rope_cos=cos, rope_sin=sin, rope_half=0,
                                        kv_written=True, **attrs)
        key_args = (lq, lk, lv, lc, *meta, hq, hkv, d, d ** -0.5, 1, 0, None, None, None, True)
        plan = state.plans[state.plan_key(*key_args)]
        stream = launcher.current_stream(device.index or 0)
        out_buffer = torch.empty((1, hq, 1, d), dtype=torch.bfloat16, device=device)  # lives as long as the rows
        address = [lq.data_ptr(), lc.data_ptr(), *(x.data_ptr() for x in meta[:3]), lq.data_ptr(),
                   out_buffer.data_ptr(), *([out_buffer.data_ptr()] * 3), lq.data_ptr()]
        rows["written_call_op"] = lambda: trtopt_ops.paged_attention_rope(
            lq, lk, lv, lc, *meta, rope_cos=cos, rope_sin=sin, rope_half=0, kv_written=True, **attrs)
        rows["written_call_kernel_entry"] = lambda: pk.paged_attention_triton(lq, lk, lv, lc, *meta, kv_written=True,
                                                                              **attrs)
        rows["written_plan_key"] = lambda: state.plan_key(*key_args)
        rows["written_plan_call"] = lambda: plan(lq, lk, lv, lc, *meta, None, None, None)
        rows["written_out_empty"] = lambda: torch.empty((1, hq, 1, d), dtype=torch.bfloat16, device=device)
        rows["written_current_stream"] = lambda: launcher.current_stream(device.index or 0)
        rows["written_current_device"] = torch.cuda.current_device
        if isinstance(plan.attention, launcher.DriverLaunch):
            rows["written_driver_launch"] = lambda: plan.attention.launch(stream, address)
        result["direct_output_equal"] = direct_output_equal(launches, q, k, v, cache, tables, seq_lens, qsl, slots,
                                                            attrs)
    # The rows whose launches go through `state`'s launcher (the others follow TRTOPT_TRITON_DISPATCH).
    both_ways = {"write_kv_launch", "rope_write_kv_launch", "paged_attention_call", "paged_attention_rope_call",
                 *per_layer}
    rows.update(per_layer)
    for name, fn in rows.items():
        calls = LAYERS if name in per_layer else 1
        result[f"{name}_us"] = per_call_us(fn, args.n // calls, device) / calls
        print(f"{name:<36} {result[f'{name}_us']:8.2f} us/call")
        if name in both_ways:
            state.launcher.dispatcher_only = True
            result[f"{name}_dispatcher_us"] = per_call_us(fn, args.n // calls, device) / calls
            state.launcher.dispatcher_only = False
            print(f"{name + ' (dispatcher)':<36} {result[f'{name}_dispatcher_us']:8.2f} us/call")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
