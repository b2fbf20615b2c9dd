"""The CUDA decode kernel over FP8 pools (paged_attention/decode_cuda.py) against the fp32 reference: head sizes,
groups, q dtypes, windows, causal or not, segments and pipelining; steps with an uneven split of tokens; the planned
per-layer launches, CUDA graphs and per-layer scales; which steps it serves. GPU tests, but for the plan's and the
dispatch rule's pure logic."""

from __future__ import annotations

import random

import pytest
import torch

from test_paged_attention_reference import make_step
from trtopt.plugins.paged_attention import decode_cuda
from trtopt.plugins.paged_attention.reference import paged_attention_ref, pool_values, quantized_pool

INPUT_NAMES = ["q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"]


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")(test))


def test_plan_splits_small_grids_and_stages_their_loads():
    """Segments double while the grid stays within three CTAs an SM, each segment keeping >= 128 keys, up to 64;
    3 cp.async stages up to head_dim 128, register double-buffering above (H200: 132 SMs)."""
    def plan(*shape, head_dim=128):
        p = decode_cuda.plan_cuda_decode(*shape, 132, head_dim)
        return p.num_segments, p.stages, p.pipe

    assert plan(64, 8, 4096) == (1, 3, False)  # 512 CTAs already
    assert plan(16, 8, 8192) == (2, 3, False)
    assert plan(1, 8, 32768) == (32, 3, False)
    assert plan(32, 3, 2048, head_dim=64) == (4, 3, False)  # 384 CTAs
    assert plan(3, 8, 1008) == (4, 3, False)  # 252 keys a segment
    assert plan(1, 8, 100) == (1, 3, False)
    assert plan(1, 1, 1 << 20, head_dim=256) == (64, 0, True)  # at most 64 segments


@pytest.mark.parametrize("bad", [dict(num_segments=3), dict(num_segments=0), dict(num_segments=256),
                                 dict(num_segments=2, stages=1), dict(num_segments=1, pipe=True, stages=3)])
def test_plans_the_kernel_cannot_take_are_refused(bad):
    with pytest.raises(ValueError, match="num_segments|stages"):
        decode_cuda.CudaDecodePlan(**bad)


def test_cpu_steps_are_not_served():
    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    pool = torch.zeros(2, 2, 1, 16, 128, dtype=torch.float8_e4m3fn)
    from trtopt.plugins.launcher import Launcher

    assert decode_cuda.why_not(q, pool, num_tokens=1, num_seqs=1, group=4, head_dim=128, alibi_slopes=None,
                               launcher=Launcher()) == "not an FP8 pool on a GPU"


def fp8_decode_step(seed: int, context_lens, new_tokens, *, num_heads, num_kv_heads, head_dim, dtype, k_scale,
                    v_scale, nan_past_end=True):
    """A step over an FP8 pool of 16-token blocks (the new tokens written by the call), with NaN in every slot past
    a sequence's keys in its last block: a read there would poison the output."""
    step = make_step(random.Random(seed), context_lens=context_lens, new_tokens=new_tokens, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16)
    step["kv_cache"] = quantized_pool(step["kv_cache"], k_scale, v_scale)
    if nan_past_end:
        bytes_ = step["kv_cache"].view(torch.uint8)
        for row, length in zip(step["block_tables"].tolist(), step["seq_lens"].tolist()):
            last = row[(length - 1) // 16]
            bytes_[last, 0, :, length % 16 or 16:] = 0x7F
            pool_values(bytes_.view(torch.float8_e4m3fn))[last, :, length % 16 or 16:] = float("nan")
    for name in ("q", "k", "v"):
        step[name] = step[name].to(dtype)
    return step


def reference(step: dict, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    args = [step[name].clone() for name in INPUT_NAMES]
    for i in (0, 1, 2):
        args[i] = args[i].float()
    return paged_attention_ref(*args, **attrs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).abs().max() / want.abs().max())


P = decode_cuda.CudaDecodePlan
# (Hq, Hkv, head_dim, q dtype, sliding window, causal, plan: segments, registers double-buffered, cp.async stages)
CASES = [
    (32, 8, 128, torch.bfloat16, 0, 1, P(1)),
    (32, 8, 128, torch.bfloat16, 0, 1, P(4, pipe=True)),
    (32, 8, 128, torch.bfloat16, 0, 1, P(2, stages=3)),
    (32, 8, 128, torch.bfloat16, 0, 1, P(8, stages=3, pdl=False)),  # serialized launches
    (9, 3, 64, torch.bfloat16, 0, 1, P(2)),  # SmolLM2-135M's heads
    (9, 3, 64, torch.bfloat16, 0, 1, P(1, stages=4)),
    (4, 1, 256, torch.bfloat16, 48, 1, P(1, pipe=True)),  # Gemma-3-270m's, with a window ending mid-block
    (4, 1, 256, torch.float16, 48, 1, P(8, stages=2)),
    (4, 1, 256, torch.bfloat16, 0, 1, P(64, pipe=True)),  # 64 segments: more than the merge's loads ahead
    (16, 2, 192, torch.float16, 0, 0, P(2, pipe=True)),  # not causal; group 8
    (16, 2, 192, torch.float16, 0, 0, P(1, stages=2)),
    (6, 6, 64, torch.bfloat16, 20, 0, P(1)),  # MHA (group 1), a window without causality
]


def case_id(case) -> str:
    *head, plan = case
    return ("-".join(map(str, head)).replace("torch.", "")
            + f"-s{plan.num_segments}p{int(plan.pipe)}a{plan.stages}" + ("" if plan.pdl else "-serial"))


@on_gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.02)])
def test_cuda_decode_equals_the_reference(case, scales):
    Hq, Hkv, D, dtype, window, causal, plan = case
    k_scale, v_scale = scales
    contexts = [1, 16, 17, 100, 257, 1000]  # one key, a whole block, a block and one, partial last blocks
    step = fp8_decode_step(3, contexts, [1] * len(contexts), num_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                           dtype=dtype, k_scale=k_scale, v_scale=v_scale)
    attrs = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5, causal=causal, sliding_window=window,
                 k_scale=k_scale, v_scale=v_scale)
    want, want_pool = reference(step, attrs)
    assert want.isfinite().all()
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    args = [step[name].clone().cuda() for name in INPUT_NAMES]
    out, pool = paged_attention_triton(*args, **attrs, launch=plan, state=PagedLaunchState())
    assert torch.equal(pool.cpu().view(torch.uint8), want_pool.view(torch.uint8))  # the write is Triton's
    # q and the probabilities are held in fp16 for the dots (as the Triton kernel's FP8 path does): within 1% of
    # the output's max. A wrong fragment layout is off by the order of the output itself.
    assert rel_err(out, want) < 1e-2
    triton_out, _ = paged_attention_triton(*[step[name].clone().cuda() for name in INPUT_NAMES], **attrs,
                                           state=PagedLaunchState(cuda_decode=False))
    assert rel_err(out, triton_out.float().cpu()) < 1e-2


@on_gpu
def test_tokens_split_unevenly_over_sequences():
    """As many tokens as sequences, but one sequence with none and one with two (a legal step): each CTA walks its
    sequence's tokens, each attending causally up to its own position."""
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    step = fp8_decode_step(5, [40, 70, 33], [0, 2, 1], num_heads=8, num_kv_heads=2, head_dim=128,
                           dtype=torch.bfloat16, k_scale=0.5, v_scale=0.25)
    attrs = dict(num_heads=8, num_kv_heads=2, head_dim=128, scale=0.1, k_scale=0.5, v_scale=0.25)
    want, _ = reference(step, attrs)
    for plan in (P(1), P(2), P(2, stages=3)):
        args = [step[name].clone().cuda() for name in INPUT_NAMES]
        out, _ = paged_attention_triton(*args, **attrs, state=PagedLaunchState(), launch=plan)
        assert rel_err(out, want) < 1e-2


@on_gpu
def test_programmatic_dependent_launches_equal_serialized_ones():
    """With pdl (the default) the attention launch may start while the KV write runs, and the split-KV merge while
    the attention runs; each waits for its predecessor's end before reading what it wrote. Step after step, each
    writing its tokens' keys into the blocks the attention then reads (what a missing wait would read stale), the
    output is bit for bit that of serialized launches."""
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    attrs = dict(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5, k_scale=0.5, v_scale=0.25)
    for seed in range(8):
        step = fp8_decode_step(seed, [16, 17, 2048, 4000], [1, 1, 1, 1], num_heads=32, num_kv_heads=8,
                               head_dim=128, dtype=torch.bfloat16, k_scale=0.5, v_scale=0.25)
        outs = []
        for plan in (P(16, stages=3), P(16, stages=3, pdl=False)):
            out, pool = paged_attention_triton(*[step[name].clone().cuda() for name in INPUT_NAMES], **attrs,
                                               launch=plan, state=PagedLaunchState())
            outs.append((out, pool))
        for out, pool in outs[1:]:
            assert torch.equal(out, outs[0][0]) and torch.equal(pool.view(torch.uint8), outs[0][1].view(torch.uint8))
        want, _ = reference(step, attrs)
        assert rel_err(outs[0][0], want) < 1e-2


@on_gpu
def test_planned_layers_graphs_and_per_layer_scales():
    """The step the runtime makes: planned once (the plan's attention launch is this kernel), each layer with its
    own pool and scales through the plan, and a CUDA graph replay equal to the eager call bit for bit."""
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    state = PagedLaunchState()
    attrs = dict(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5)
    layers = []
    for k_scale, v_scale in [(1.0, 1.0), (0.03, 0.07)]:  # the same step (block tables), pools of other scales
        step = fp8_decode_step(0, [300, 2000, 45, 1], [1, 1, 1, 1], num_heads=32, num_kv_heads=8, head_dim=128,
                               dtype=torch.bfloat16, k_scale=k_scale, v_scale=v_scale, nan_past_end=False)
        step["slot_mapping"] = torch.full_like(step["slot_mapping"], -1)  # already written: calls repeat alike
        layers.append(({name: step[name].cuda() for name in INPUT_NAMES}, dict(k_scale=k_scale, v_scale=v_scale),
                       reference(step, {**attrs, "k_scale": k_scale, "v_scale": v_scale})[0]))
    shared = {name: layers[0][0][name] for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping")}
    outs = []
    for tensors, scales, want in layers * 2:  # the second pass is all through the plan
        out, _ = paged_attention_triton(**{**tensors, **shared}, **attrs, **scales, state=state)
        assert rel_err(out, want) < 1e-2
        outs.append(out)
    assert len(state.plans) == 1
    plan = next(iter(state.plans.values()))
    assert plan.attention.name == "fp8_paged_decode" and plan.calls == 3
    assert plan.merge.name == "fp8_merge_segments"  # 4 segments: the CUDA merge, a programmatic dependent launch
    for first, again in zip(outs[:2], outs[2:]):
        assert torch.equal(first, again)

    tensors, scales, _ = layers[1]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention_triton(**{**tensors, **shared}, **attrs, **scales, state=state)
        with torch.cuda.graph(graph, stream=stream):
            captured, _ = paged_attention_triton(**{**tensors, **shared}, **attrs, **scales, state=state)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, outs[1])


@on_gpu
def test_steps_it_does_not_serve_take_the_triton_kernel():
    from trtopt.plugins.launcher import Launcher
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    def reason(**over):
        base = dict(q=torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, device="cuda"),
                    kv_cache=torch.zeros(4, 2, 2, 16, 128, dtype=torch.float8_e4m3fn, device="cuda"),
                    num_tokens=2, num_seqs=2, group=4, head_dim=128, alibi_slopes=None, launcher=Launcher())
        return decode_cuda.why_not(**{**base, **over})

    assert reason() is None
    assert reason(num_tokens=5) == "not a decode step"
    assert reason(q=torch.zeros(1, 8, 2, 128, device="cuda")) == "q is torch.float32"
    assert reason(alibi_slopes=torch.zeros(8, device="cuda")) == "ALiBi"
    assert reason(group=16).startswith("head_dim 128, group 16")
    assert reason(kv_cache=torch.zeros(4, 2, 2, 32, 128, dtype=torch.float8_e4m3fn, device="cuda")).endswith(
        "block size 32")
    assert reason(launcher=Launcher(dispatcher_only=True)).startswith("no direct driver launch")

    step = fp8_decode_step(1, [50], [1], num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                           k_scale=1.0, v_scale=1.0)
    args = [step[name].cuda() for name in INPUT_NAMES]
    with pytest.raises(ValueError, match="does not serve this step: ALiBi"):
        paged_attention_triton(*args, num_heads=8, num_kv_heads=2, head_dim=128, scale=0.1, state=PagedLaunchState(),
                               alibi_slopes=torch.zeros(8, device="cuda"),
                               launch=decode_cuda.CudaDecodePlan(num_segments=1, pipe=False))


@on_gpu
def test_metadata_at_any_alignment():
    """The kernel reads the step metadata as ints: views that start 4 bytes into a buffer (as a caller's padded
    metadata may) are attended like aligned ones, on the planned path and on the full path."""
    from trtopt.plugins.paged_attention.kernel import PagedLaunchState, paged_attention_triton

    step = fp8_decode_step(9, [70, 300, 5], [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64,
                           dtype=torch.bfloat16, k_scale=0.5, v_scale=0.25, nan_past_end=False)
    step["slot_mapping"] = torch.full_like(step["slot_mapping"], -1)  # written already: calls repeat alike
    attrs = dict(num_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, k_scale=0.5, v_scale=0.25)
    want, _ = reference(step, attrs)
    aligned = {name: step[name].cuda() for name in INPUT_NAMES}
    shifted = dict(aligned)
    for name in ("seq_lens", "query_start_loc"):
        x = aligned[name]
        shifted[name] = torch.cat([x[:1], x])[1:]  # the same values, 4 bytes into their buffer
        assert shifted[name].data_ptr() % 16 != 0
    state = PagedLaunchState()
    for tensors in (aligned, shifted, shifted, aligned):  # plans, then the plan refuses, plans again, and back
        out, _ = paged_attention_triton(**tensors, **attrs, state=state)
        assert rel_err(out, want) < 1e-2
    out, _ = paged_attention_triton(**shifted, **attrs)  # no state: the full path alone
    assert rel_err(out, want) < 1e-2
