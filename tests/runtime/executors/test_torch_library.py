"""torch.compile of the torch executor (runtime/executors/torch_library.py): the trtopt ops as custom ops, one
specialised graph per step shape, and the same greedy tokens and logits as the eager executor."""

from __future__ import annotations

import pytest
import torch

from trtopt.builder.plan import read_plan
from trtopt.check.driver import BlockSource, Seq, make_step
from trtopt.errors import ConfigError
from trtopt.runtime.executors.torch_executor import TorchExecutor

MODEL = "tiny-llama"


def greedy_steps(ex: TorchExecutor, block_size: int, *, decode_steps: int = 3) -> tuple[list[torch.Tensor], list]:
    """A prefill of two sequences, then greedy decode steps on the executor's own argmax: (logits per step,
    tokens). Every step keeps one block-table width, so the compiled executor sees two step shapes. The executor's
    pools must hold 8 blocks."""
    source = BlockSource(8)
    seqs = [Seq(list(range(3, 3 + n))) for n in (5, 7)]
    logits = [ex.execute(make_step(seqs, [5, 7], block_size, source))]
    for _ in range(decode_steps):
        for seq, token in zip(seqs, logits[-1].argmax(-1).tolist()):
            seq.tokens.append(token)
        logits.append(ex.execute(make_step(seqs, [1, 1], block_size, source)))
    return logits, [s.tokens for s in seqs]


@pytest.mark.slow
def test_compiled_executor_matches_eager_on_cpu(plan_dir):
    """Inductor on CPU (fp32): the same greedy tokens, logits and KV pools (1e-5) as the eager executor; the graph
    holds the trtopt ops as custom ops, compiled once per step shape with no graph break (fullgraph=True)."""
    built = plan_dir(MODEL)
    plan = read_plan(built)
    eager = TorchExecutor(built, plan)
    assert eager.compiled is None and eager._module is eager.graph.module  # the default path is untouched
    compiled = TorchExecutor(built, plan, compile_mode="default")
    eager.allocate_kv_cache(8)
    compiled.allocate_kv_cache(8)
    want, want_tokens = greedy_steps(eager, plan.limits.block_size)
    got, got_tokens = greedy_steps(compiled, plan.limits.block_size)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(compiled.kv_caches, eager.kv_caches):  # PagedAttention's in-place writes survived compile
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    trtopt_nodes = [n for n in compiled.graph.module.graph.nodes if str(n.target).startswith("trtopt.")]
    assert compiled.compiled.num_custom_ops == len(trtopt_nodes) >= 2 * plan.model.num_layers
    assert sum("paged_attention" in str(n.target) for n in trtopt_nodes) == plan.model.num_layers
    # Two step shapes (the prefill, then decode), each compiled once: no recompile per step.
    assert [r.shapes["input_ids"] for r in compiled.compiled.records] == [(1, 12), (1, 2)]
    assert all(r.seconds > 0 for r in compiled.compiled.records)


def test_specialised_graph_has_no_host_shape_arithmetic(plan_dir):
    """Per step shape, every value computed from shapes alone is folded into the copy that torch.compile sees (no
    Shape/Size call, nothing read back with .tolist()), and the pools come back as the inputs they are."""
    from trtopt.runtime.executors import onnx_ops
    from trtopt.runtime.executors.torch_library import CompiledGraph, shape_derived_nodes, specialise

    built = plan_dir(MODEL)
    plan = read_plan(built)
    ex = TorchExecutor(built, plan, compile_mode="default")  # nothing compiles until a step runs
    ex.allocate_kv_cache(8)
    graph = ex.graph.module.graph
    assert shape_derived_nodes(graph), "the converted graph computes shapes on the host (what this folds)"
    step = make_step([Seq(list(range(3, 9)))], [6], plan.limits.block_size, BlockSource(8))
    args: list = [None] * len(ex.graph.input_names)
    for name, position in ex._step_positions.items():
        args[position] = getattr(step, name)
    for layer, position in enumerate(ex._kv_positions):
        args[position] = ex.kv_caches[layer]
    gm, passthrough = specialise(ex.graph.module, tuple(args))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {onnx_ops.shape, onnx_ops.size} and not shape_derived_nodes(gm.graph)
    assert sorted(passthrough.values()) == sorted(ex._kv_positions)
    with torch.inference_mode():
        want = ex.graph.module(*args)
        got = gm(*args)
    torch.testing.assert_close(got[ex._logits_position], want[ex._logits_position], atol=0, rtol=0)
    assert isinstance(ex.compiled, CompiledGraph)


def test_unknown_compile_mode_is_a_config_error(plan_dir):
    built = plan_dir(MODEL)
    with pytest.raises(ConfigError, match="reduce-overhead.*not supported"):
        TorchExecutor(built, read_plan(built), compile_mode="reduce-overhead")


@pytest.mark.gpu
def test_compiled_executor_replays_graphs_with_eager_logits_on_cuda(plan_dir):
    """On CUDA the CUDA graphs capture the compiled callable (one compile per bucket, at capture) and every step
    replays one, with the eager executor's greedy tokens and logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    built = plan_dir(MODEL)
    plan = read_plan(built)
    runs = {}
    for mode in (None, "default"):
        ex = TorchExecutor(built, plan, device="cuda", cuda_graphs=True, compile_mode=mode)
        ex.allocate_kv_cache(8)
        report = ex.capture_graphs(max_num_seqs=2, max_num_tokens=16)
        assert report.num_graphs == len(ex.graphs.buckets) == 3  # T = 1, 2, 16
        if mode is not None:
            assert len(ex.compiled.records) == 3  # one compile per bucket, all at capture
        logits, tokens = greedy_steps(ex, plan.limits.block_size, decode_steps=4)
        assert ex.graphs.num_eager == 0 and ex.graphs.num_replayed == 5
        if mode is not None:
            assert len(ex.compiled.records) == 3  # replays never compile
        runs[mode] = (torch.cat(logits).cpu(), tokens)
    assert runs["default"][1] == runs[None][1]
    torch.testing.assert_close(runs["default"][0], runs[None][0], atol=1e-4, rtol=0)


def _spy_paged_attention(monkeypatch) -> list:
    """Record the `state` every trtopt_ops.paged_attention call gets (the custom op calls it by module attribute)."""
    from trtopt.runtime.executors import trtopt_ops

    seen, real = [], trtopt_ops.paged_attention

    def spy(*args, state=None, **kwargs):
        seen.append(state)
        return real(*args, state=state, **kwargs)

    monkeypatch.setattr(trtopt_ops, "paged_attention", spy)
    return seen


def test_paged_attention_custom_op_takes_the_current_launch_state(monkeypatch):
    """A custom op cannot be handed a Python object: trtopt::paged_attention passes on the PagedLaunchState the
    running executor set (trtopt_ops.CURRENT_PAGED_STATE), the very object, and None outside any forward (the kernel
    then makes a state of the call's own); the answer is the same either way."""
    from trtopt.plugins.paged_attention.planning import PagedLaunchState
    from trtopt.runtime.executors import torch_library, trtopt_ops  # noqa: F401  (registers the custom ops)

    seen = _spy_paged_attention(monkeypatch)
    hq, hkv, d, bs, t = 4, 2, 16, 16, 3
    torch.manual_seed(0)
    q, k, v = torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    step = (torch.tensor([[1]], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
            torch.tensor([0, t], dtype=torch.int32), torch.arange(bs, bs + t, dtype=torch.int64))
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5)
    op = torch.ops.trtopt.paged_attention.default
    state, outs = PagedLaunchState(), []
    for current in (state, None):
        cache = torch.zeros(4, 2, hkv, bs, d)
        token = trtopt_ops.CURRENT_PAGED_STATE.set(current)
        try:
            outs.append(op(q, k, v, cache, *step, None, **attrs))
        finally:
            trtopt_ops.CURRENT_PAGED_STATE.reset(token)
    assert len(seen) == 2 and seen[0] is state and seen[1] is None
    assert trtopt_ops.CURRENT_PAGED_STATE.get() is None
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.slow
def test_compiled_executor_hands_its_launch_state_to_every_paged_attention(plan_dir, monkeypatch):
    """Under compile_mode the executor sets its own PagedLaunchState as the current one around each forward (the
    eager run that specialises a step shape, the compiled run, a CUDA-graph capture): every PagedAttention of the
    step gets that object, and none is left set after the step. (Off CUDA the executor has no state of its own;
    the test gives it one.)"""
    from trtopt.plugins.paged_attention.planning import PagedLaunchState
    from trtopt.runtime.executors import trtopt_ops

    built = plan_dir(MODEL)
    plan = read_plan(built)
    ex = TorchExecutor(built, plan, compile_mode="default")
    assert ex.paged_state is None  # CPU: PagedAttention runs no Triton kernel here
    assert not any(n.op == "get_attr" and n.target == "paged_state" for n in ex.graph.module.graph.nodes)
    ex.paged_state = PagedLaunchState()
    ex.allocate_kv_cache(8)
    seen = _spy_paged_attention(monkeypatch)
    source = BlockSource(8)
    seqs = [Seq(list(range(3, 8))), Seq(list(range(4, 9)))]
    ex.execute(make_step(seqs, [5, 5], plan.limits.block_size, source))
    layers = plan.model.num_layers
    # The eager run that specialised the shape, the compiled graph's first run (compiling), the step: a call per
    # layer each.
    assert len(seen) == 3 * layers and all(s is ex.paged_state for s in seen)
    for step in range(2):  # a decode step, a new shape (compiled again); then that shape again (the step only)
        for seq in seqs:
            seq.tokens.append(7 + step)
        ex.execute(make_step(seqs, [1, 1], plan.limits.block_size, source))
    assert len(seen) == 7 * layers and all(s is ex.paged_state for s in seen)
    assert trtopt_ops.CURRENT_PAGED_STATE.get() is None
