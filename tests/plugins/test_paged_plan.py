"""PagedAttention planned once per step shape and launched per layer (attention.py `_PagedPlan`).

The first call of a shape checks its inputs, plans the tiling and prepares the launches; every later call with the
same shapes, strides, dtypes and devices (the other layers of the step, and later steps) only allocates its outputs
and launches those, with its own tensors. These tests hold the planned calls to the full path's output bit for bit
(the full path is forced with an explicit `launch`, the very tiling the plan chose), across several layers of one
step, a next step with new metadata tensors, the RoPE fold, split-KV, ALiBi and a sliding window; and check that
what a plan cannot serve (another dtype, bad metadata, a misaligned view on a GPU) takes the full path, which
checks it. On the CPU the plan's launches go through the Triton interpreter (launcher.Relaunch); on a GPU through
the CUDA driver (launcher.DriverLaunch), which is also asserted. Each test owns its PagedLaunchState (planning.py),
as an executor does.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_paged_attention_kernel import Case, make_step, rope_tables

from trtopt.plugins import launcher
from trtopt.plugins.paged_attention import attention, decode_cuda, planning
from trtopt.plugins.paged_attention import kernel as pk

CASES = {
    "decode_gqa4": Case(context=(40, 3), new=(1, 1), num_heads=8, num_kv_heads=2),
    "mixed_mqa": Case(context=(0, 21, 9), new=(13, 5, 1), num_heads=4, num_kv_heads=1, seed=1),
    # 600 cached keys: 2 key-range segments under the interpreter, 4 on a GPU (the merge kernel runs).
    "split_kv": Case(context=(600,), new=(1,), num_heads=4, num_kv_heads=2, seed=2),
    "alibi_window": Case(context=(25, 4), new=(5, 1), num_heads=8, num_kv_heads=2, alibi=True, sliding_window=7,
                         seed=3),
    "bf16_decode": Case(context=(70, 17), new=(1, 1), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, seed=4),
}


def layer_tensors(step, layers: int):
    """Each layer's q, k, v and pool: other values, the same shapes and strides (clone keeps the transposed views'
    strides; the pool's NaN poison stays where it was)."""
    out = []
    for i in range(layers):
        q, k, v, pool = (x.clone() for x in (step.q, step.k, step.v, step.kv_cache))
        for x in (q, k, v, pool):
            x.mul_(1 + i / 8)
        out.append((q, k, v, pool))
    return out


def full_path_launch(step, device, pool: torch.Tensor | None = None):
    """The tiling the plan picks for this step over `pool` (default: the step's), passed explicitly: an explicit
    launch bypasses the plan (where an FP8 pool's decode step takes the CUDA kernel, that kernel's plan). An FP8
    pool plans other tiles on a GPU (kv_bytes=1), the same ones under the interpreter, so only the GPU run tells a
    pool-blind tiling here from the plan's."""
    pool = step.kv_cache if pool is None else pool
    T, S = step.q.shape[2], step.seq_lens.shape[0]
    Hq, Hkv = step.attrs["num_heads"], step.attrs["num_kv_heads"]
    max_context = step.block_tables.shape[1] * pool.shape[3]
    cuda = decode_cuda.choose(step.q, pool, num_tokens=T, num_seqs=S, group=Hq // Hkv, head_dim=step.attrs["head_dim"],
                              alibi_slopes=step.alibi_slopes, launcher=launcher.Launcher(), max_context=max_context,
                              sm_count=planning._device_sm_count(device))
    if cuda is not None:
        return cuda
    return pk.plan_paged_launch(T, S, Hkv, Hq // Hkv, max_context, planning._device_sm_count(device),
                                interpret=device.type != "cuda", kv_bytes=pool.element_size())


def call(step, q, k, v, pool, rope, state, **extra):
    return pk.paged_attention_triton(q, k, v, pool, step.block_tables, step.seq_lens, step.query_start_loc,
                                     step.slot_mapping, alibi_slopes=step.alibi_slopes, **rope, **step.attrs,
                                     state=state, **extra)


def assert_every_parameter_passed(prepared: launcher.Relaunch) -> None:
    """Every kernel parameter is in the launch (positional or by name): the launcher keeps a compiled kernel, and
    prepares a cuLaunchKernel launch from it, only for such calls; a defaulted constexpr left out sends every launch
    through Triton's dispatcher (the GPU test's DriverLaunch assertion caught one; this checks it on the CPU)."""
    fn = getattr(prepared.kernel, "fn", prepared.kernel)
    names = list(inspect.signature(fn).parameters)
    missing = [n for n in names[len(prepared.args):] if n not in prepared.kwargs]
    assert not missing, f"{names[0]}...: launched without {missing}"


def plan_calls(state) -> int:
    return sum(plan.calls for plan in state.plans.values())


def assert_layers_equal_full_path(step, rope, device, state, layers=3):
    """Run `layers` layers through the planned path and through the full path; outputs and pools bit for bit."""
    planned, full = layer_tensors(step, layers), layer_tensors(step, layers)
    launch = full_path_launch(step, device)
    before = plan_calls(state)
    for (q, k, v, pool), (fq, fk, fv, fpool) in zip(planned, full):
        got, _ = call(step, q, k, v, pool, rope, state)
        want, _ = call(step, fq, fk, fv, fpool, rope, state, launch=launch)
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(pool, fpool, atol=0, rtol=0, equal_nan=True)
    return plan_calls(state) - before


@pytest.mark.parametrize("name, rope", [(n, r) for n in CASES for r in (False, True) if not CASES[n].alibi])
def test_planned_layers_equal_the_full_path(name, rope, kernel_device):
    state = pk.PagedLaunchState()
    case = CASES[name]
    step = make_step(case, kernel_device)
    tables = dict(zip(("rope_cos", "rope_sin"), rope_tables(case, kernel_device))) if rope else {}
    # The first layer plans (full path), the other two are served by the plan.
    assert assert_layers_equal_full_path(step, tables, kernel_device, state) == 2
    assert len(state.plans) == 1
    (plan,) = state.plans.values()
    if kernel_device.type == "cuda":
        assert isinstance(plan.attention, launcher.DriverLaunch) and plan.cuda == step.q.device.index
    else:  # the interpreter's Relaunches hold what a GPU's driver launch is prepared from
        for prepared in (plan.kv_write, plan.attention, plan.merge):
            if prepared is not None:
                assert_every_parameter_passed(prepared)
    # The next step: new metadata tensors of the same shapes (other blocks, other slots): the same plan serves it.
    nxt = make_step(dataclasses.replace(case, seed=case.seed + 10), kernel_device)
    assert assert_layers_equal_full_path(nxt, tables, kernel_device, state) == 3
    assert len(state.plans) == 1


def test_planned_alibi_and_window(kernel_device):
    state = pk.PagedLaunchState()
    step = make_step(CASES["alibi_window"], kernel_device)
    assert assert_layers_equal_full_path(step, {}, kernel_device, state) == 2


def test_what_a_plan_cannot_serve_takes_the_checked_path(kernel_device):
    state = pk.PagedLaunchState()
    case = CASES["decode_gqa4"]
    step = make_step(case, kernel_device)
    assert_layers_equal_full_path(step, {}, kernel_device, state, layers=2)
    assert len(state.plans) == 1
    # Another dtype is another key: a second plan, not the first one misused.
    half = make_step(dataclasses.replace(case, dtype=torch.float16), kernel_device)
    assert_layers_equal_full_path(half, {}, kernel_device, state, layers=2)
    assert len(state.plans) == 2
    # Bad inputs still meet the checks, with plans for their shapes' good twins in place.
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.paged_attention_triton(step.q, step.k, step.v, step.kv_cache, step.block_tables, step.seq_lens,
                                  step.query_start_loc, step.slot_mapping.int(), **step.attrs, state=state)
    with pytest.raises(ValueError, match="kv_cache"):
        pk.paged_attention_triton(step.q, step.k, step.v, step.kv_cache[:, :, :1], step.block_tables,
                                  step.seq_lens, step.query_start_loc, step.slot_mapping, **step.attrs,
                                  state=state)
    cos, sin = rope_tables(case, kernel_device)
    with pytest.raises(ValueError, match="together"):
        pk.paged_attention_triton(step.q, step.k, step.v, step.kv_cache, step.block_tables, step.seq_lens,
                                  step.query_start_loc, step.slot_mapping, rope_cos=cos, **step.attrs,
                                  state=state)
    # A call without a state plans nothing, and leaves the caller's plans alone.
    before = plan_calls(state)
    call(step, *layer_tensors(step, 1)[0], {}, None)
    assert plan_calls(state) == before and len(state.plans) == 2
    # With launches through the dispatcher only (the A/B baseline), no plan is used or made.
    state.launcher.dispatcher_only = True
    call(step, *layer_tensors(step, 1)[0], {}, state)
    assert plan_calls(state) == before and len(state.plans) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_misaligned_view_falls_back_to_the_full_path():
    """The kernels are specialised on 16-byte alignment; a q view 2 bytes off it, with a plan made for aligned
    views of the same strides, must not be launched with the aligned kernel: the plan refuses it, the full path
    launches the right one, and the output equals the full path's."""
    device = torch.device("cuda")
    state = pk.PagedLaunchState()
    case = CASES["bf16_decode"]
    step = make_step(case, device)
    Hq, T, D = step.q.shape[1:]
    storage = torch.randn(T * Hq * D + 1, device=device, dtype=torch.bfloat16)
    launch = full_path_launch(step, device)
    for offset in (0, 1, 0, 1):
        q = storage[offset:offset + T * Hq * D].view(1, T, Hq, D).transpose(1, 2)
        pool, full_pool = step.kv_cache.clone(), step.kv_cache.clone()
        got, _ = call(step, q, step.k, step.v, pool, {}, state)
        want, _ = call(step, q, step.k, step.v, full_pool, {}, state, launch=launch)
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(pool, full_pool, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rope", [False, True])
def test_gpu_plan_on_another_stream_and_in_a_captured_graph(rope):
    """A plan keeps its workspace (rotated q, split-KV partials) for the stream it was first used on. On another
    stream, and while a CUDA graph is captured, it must use a workspace of its own; the captured driver launches
    must replay to the full path's output."""
    device = torch.device("cuda")
    state = pk.PagedLaunchState()
    case = CASES["split_kv"]
    step = make_step(case, device)
    tables = dict(zip(("rope_cos", "rope_sin"), rope_tables(case, device))) if rope else {}
    launch = full_path_launch(step, device)
    assert assert_layers_equal_full_path(step, tables, device, state, layers=2) == 1
    (plan,) = state.plans.values()
    assert plan.owned is not None and plan.scratch is not None
    kept = plan.owned[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    (q, k, v, pool), (fq, fk, fv, fpool) = layer_tensors(step, 1)[0], layer_tensors(step, 1)[0]
    with torch.cuda.stream(side):
        got, _ = call(step, q, k, v, pool, tables, state)
    torch.cuda.current_stream().wait_stream(side)
    want, _ = call(step, fq, fk, fv, fpool, tables, state, launch=launch)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert plan.owned[1] is kept, "a call on another stream replaced the kept workspace"
    # Captured: the plan serves the call inside the graph, with a workspace the graph owns.
    (q, k, v, pool), (fq, fk, fv, fpool) = layer_tensors(step, 1)[0], layer_tensors(step, 1)[0]
    calls = plan.calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, _ = call(step, q, k, v, pool, tables, state)
    assert plan.calls == calls + 1 and plan.owned[1] is kept
    graph.replay()
    torch.cuda.synchronize()
    want, _ = call(step, fq, fk, fv, fpool, tables, state, launch=launch)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(pool, fpool, atol=0, rtol=0, equal_nan=True)



FP8_LAYER_SCALES = [(0.5, 3.0), (0.0129, 0.0131), (2.0, 0.25), (0.0129, 0.0131)]  # calibrated: one pair a layer


@pytest.mark.parametrize("rope", [False, True])
def test_fp8_layers_with_their_own_scales_share_one_plan(rope, kernel_device):
    """A calibrated FP8 plan scales each layer's pool differently. The scales are runtime scalars of the launches
    (write_kv.py), not part of the plan key: the first layer plans and every other layer is served by that plan,
    launching with its own scales (set per call), bit for bit the full path given the same scales. A scale left
    over from the layer before would differ: every pair differs from the one before it."""
    from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE, quantized_pool

    state = pk.PagedLaunchState()
    case = dataclasses.replace(CASES["decode_gqa4"], dtype=torch.bfloat16, seed=5)
    step = make_step(case, kernel_device)
    tables = dict(zip(("rope_cos", "rope_sin"), rope_tables(case, kernel_device))) if rope else {}
    for i, (k_scale, v_scale) in enumerate(FP8_LAYER_SCALES):
        pool = quantized_pool(step.kv_cache.float() * (1 + i / 8), k_scale, v_scale)
        launch = full_path_launch(step, kernel_device, pool)
        planned, full = ([x.clone() for x in (step.q, step.k, step.v, pool)] for _ in range(2))
        got, _ = call(step, *planned, tables, state, k_scale=k_scale, v_scale=v_scale)
        want, _ = call(step, *full, tables, state, k_scale=k_scale, v_scale=v_scale, launch=launch)
        assert planned[3].dtype == FP8_POOL_DTYPE
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        assert torch.equal(planned[3].view(torch.uint8), full[3].view(torch.uint8))
    assert len(state.plans) == 1 and plan_calls(state) == len(FP8_LAYER_SCALES) - 1
    (plan,) = state.plans.values()
    assert len(plan.scaled) == 2  # the KV write (or the RoPE-fused one) and the attention take the scales
    if kernel_device.type == "cuda":
        assert isinstance(plan.attention, launcher.DriverLaunch)

# The tests above run on the CPU (interpreter) in `make test`; on a GPU, `pytest -m gpu` runs them through the
# driver launches (and asserts that path is the one taken).
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name, rope", [(n, r) for n in CASES for r in (False, True) if not CASES[n].alibi])
def test_gpu_planned_layers_equal_the_full_path(name, rope):
    test_planned_layers_equal_the_full_path(name, rope, torch.device("cuda"))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rope", [False, True])
def test_gpu_fp8_layers_with_their_own_scales_share_one_plan(rope):
    test_fp8_layers_with_their_own_scales_share_one_plan(rope, torch.device("cuda"))


@pytest.mark.gpu
@requires_cuda
def test_gpu_planned_alibi_and_what_a_plan_cannot_serve():
    test_planned_alibi_and_window(torch.device("cuda"))
    test_what_a_plan_cannot_serve_takes_the_checked_path(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_plans_keep_no_workspace_past_their_budget():
    """Past its state's budget a plan allocates its workspace per call instead of keeping it: same output."""
    device = torch.device("cuda")
    state = pk.PagedLaunchState(max_owned_bytes=0)
    step = make_step(CASES["split_kv"], device)
    tables = dict(zip(("rope_cos", "rope_sin"), rope_tables(CASES["split_kv"], device)))
    assert assert_layers_equal_full_path(step, tables, device, state) == 2
    (plan,) = state.plans.values()
    assert plan.owned is None and plan.workspace_bytes > 0


def test_metadata_resized_in_place_is_read_again():
    """The metadata memo matches by identity and shape: a block table resized in place between calls gives a new
    key, not the old plan's."""
    tables = torch.zeros(2, 4, dtype=torch.int32)
    rest = (torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    memo = planning._MetadataMemo()
    before = memo.key(tables, *rest)
    assert memo.key(tables, *rest) is before
    tables.resize_(2, 8)
    after = memo.key(tables, *rest)
    assert after != before and after[0][0] == (2, 8)


def test_metadata_check_is_forgotten_with_the_tensors():
    """One memo serves the plan key and the full path's once-per-step metadata check: new tensors are checked
    again, even where the tensors last seen passed for the same step shape."""
    step = make_step(CASES["decode_gqa4"], torch.device("cpu"))
    args = (step.q, step.k, step.v, step.kv_cache, step.block_tables, step.seq_lens, step.query_start_loc)
    attrs = (step.attrs["num_heads"], step.attrs["num_kv_heads"], step.attrs["head_dim"], None)
    memo = planning._MetadataMemo()
    attention._check_paged_inputs(*args, step.slot_mapping, *attrs, memo)
    assert memo.checked == (step.q.shape[2], step.q.device)
    with pytest.raises(ValueError, match="slot_mapping"):
        attention._check_paged_inputs(*args, step.slot_mapping.int(), *attrs, memo)
    assert memo.checked is None
