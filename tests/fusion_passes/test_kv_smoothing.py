"""kv_smoothing: Sub(k, b_k), Sub(v, b_v) before every PagedAttention and Add(out, b_v) after it. Exact whatever b
is, so on float32 pools the tiny Llama plan smoothed with large arbitrary means gives the plan's logits on
onnxruntime (the pass is applied to a plan with model-dtype pools here, which the build does not allow: it is exact
there and pays only with FP8); and kv_stats reads the means of what the pools hold."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from trtopt.builder.kv_calibration import calibration_windows
from trtopt.runtime.kv_calibration import kv_stats
from trtopt.builder.plan import MODEL_FILE, read_plan
from trtopt.fusion_passes.kv_rotation import rotate_qk
from trtopt.fusion_passes.kv_smoothing import INITIALIZER_PREFIX, smooth_kv
from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.executors.ort_executor import OrtExecutor
from trtopt.runtime.input_builder import InputBuilder

MODEL = "tiny-llama"  # 4 query heads on 2 KV heads of 16


def _means(plan, seed: int, size: float) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    m = plan.model
    return [size * rng.standard_normal((m.num_kv_heads, m.head_dim)) for _ in range(m.num_layers)]


def _rewritten(plan_dir, out, rewrite) -> object:
    model = ir.from_proto(onnx.load(str(plan_dir / MODEL_FILE)))
    rewrite(model)
    out.mkdir()
    onnx.save(ir.to_proto(model), str(out / MODEL_FILE))
    shutil.copy(plan_dir / "plan.json", out / "plan.json")
    return out


def _steps(plan):
    """A prefill of 37 tokens over three blocks, then three decode steps reading the stored keys back."""
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 5000, 40)]
    batches = [ScheduledBatch([ScheduledSeq("a", tokens[:37], 0, [1, 2, 3], True,
                                            prompt_logprob_positions=range(37))], 37, [])]
    batches += [ScheduledBatch([ScheduledSeq("a", [tokens[i]], i, [1, 2, 3], True)], 1, []) for i in range(37, 40)]
    return [builder.build(b) for b in batches]


@pytest.mark.parametrize("values", [False, True], ids=["k", "kv"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "hadamard"])
def test_smoothing_on_float32_pools_leaves_the_logits_unchanged_on_onnxruntime(plan_dir, tmp_path, values, rotate):
    source = plan_dir(MODEL)
    plan = read_plan(source)
    assert plan.kv_pool_dtype == "float32" and plan.model.num_heads == 2 * plan.model.num_kv_heads
    b_k, b_v = _means(plan, 1, 4.0), _means(plan, 2, 4.0)

    def rewrite(model):
        assert smooth_kv(model, b_k, b_v if values else None) == plan.model.num_layers
        if rotate:  # the build's order: smoothing in fuse, the rotation after sharding
            rotate_qk(model)

    smoothed = _rewritten(source, tmp_path / "smoothed", rewrite)
    base = _rewritten(source, tmp_path / "base", rotate_qk if rotate else lambda m: None)
    graph = onnx.load(str(smoothed / MODEL_FILE), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    consumers = {name: [n for n in graph.node if name in n.input] for node in graph.node for name in node.output}
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    for layer, node in enumerate(attention):
        k = produced_by[node.input[1]]
        sub = produced_by[k.input[0]] if rotate else k
        assert sub.op_type == "Sub" and sub.input[1] == f"{INITIALIZER_PREFIX}k_{layer}"
        assert produced_by[sub.input[0]].op_type == "Rope"  # post-RoPE, as the pools store it
        v = produced_by[node.input[2]]
        assert (v.op_type == "Sub" and v.input[1] == f"{INITIALIZER_PREFIX}v_{layer}") == values
        (user,) = consumers[node.output[0]]
        assert (user.op_type == "Add" and user.input[1] == f"{INITIALIZER_PREFIX}v_out_{layer}") == values
    expected = (3 if values else 1) * plan.model.num_layers
    assert sum(t.name.startswith(INITIALIZER_PREFIX) for t in graph.initializer) == expected

    executors = {name: OrtExecutor(d, plan) for name, d in (("base", base), ("smoothed", smoothed))}
    for ex in executors.values():
        ex.allocate_kv_cache(8)
    for inputs in _steps(plan):
        logits = {name: ex.execute(inputs).numpy() for name, ex in executors.items()}
        np.testing.assert_allclose(logits["smoothed"], logits["base"], rtol=0, atol=1e-4)
    # The pools hold k - b_k (rotated or not) and v - b_v: written slots are blocks 1..3, offsets up to 40 tokens.
    for layer in (0, plan.model.num_layers - 1):
        pools = {name: np.asarray(ex.kv_caches[layer])[1:4] for name, ex in executors.items()}  # [3, 2, Hkv, 16, D]

        def tokens(pool, kv):  # [Hkv, 40, D]
            return pool[:, kv].transpose(1, 0, 2, 3).reshape(pool.shape[2], -1, pool.shape[-1])[:, :40]

        if not rotate:  # (rotated: both pools hold keys times H)
            np.testing.assert_allclose(tokens(pools["smoothed"], 0), tokens(pools["base"], 0) - b_k[layer][:, None],
                                       atol=1e-4)
        shift = b_v[layer][:, None] if values else 0.0
        np.testing.assert_allclose(tokens(pools["smoothed"], 1), tokens(pools["base"], 1) - shift, atol=1e-4)


def test_kv_stats_are_the_means_and_amaxes_of_what_the_pools_hold(plan_dir):
    """kv_stats' mean and per-head amax over two windows equal those of the K and V slots an executor's pools hold
    after prefilling the same windows (the tiny Llama's real tokenizer and data.py's calibration text)."""
    from trtopt.runtime.config import load_tokenizer
    from trtopt.runtime.executors import create_executor

    source = plan_dir(MODEL)
    plan = read_plan(source)
    windows = calibration_windows(load_tokenizer(source), max_len=plan.limits.max_model_len, windows=2, window=40)
    assert windows.shape == (2, 40)
    model = ir.from_proto(onnx.load(str(source / MODEL_FILE)))
    outputs = [v.name for v in model.graph.outputs]
    calls = []
    means = kv_stats(model, windows, block_size=plan.limits.block_size, device="cpu", on_window=lambda: calls.append(1))
    assert [v.name for v in model.graph.outputs] == outputs  # the extra outputs are gone again
    assert len(calls) == 2 and means.tokens == 80 and len(means.k) == len(means.v) == plan.model.num_layers
    assert means.k[0].shape == (plan.model.num_kv_heads, plan.model.head_dim)

    executor = create_executor("torch", source, plan)
    executor.allocate_kv_cache(8)
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    sums = [0.0] * plan.model.num_layers
    amaxes = [torch.zeros(2, plan.model.num_kv_heads, dtype=torch.float64)] * plan.model.num_layers
    for window in windows:
        executor.execute(builder.build(ScheduledBatch([ScheduledSeq("w", window.tolist(), 0, [1, 2, 3], True)], 40,
                                                      [])))
        for layer, pool in enumerate(executor.kv_caches):
            # [3 blocks, 2, Hkv, 16, D] -> [2 (K, V), Hkv, 48 slots, D], the window's 40 first
            slots = pool[1:4].permute(1, 2, 0, 3, 4).reshape(2, plan.model.num_kv_heads, -1, plan.model.head_dim)
            slots = slots[:, :, :40]
            sums[layer] = sums[layer] + slots.double().sum(dim=2)  # [2, Hkv, D]
            amaxes[layer] = torch.maximum(amaxes[layer], slots.double().abs().amax(dim=(2, 3)))  # [2, Hkv]
    for layer in range(plan.model.num_layers):
        expected = (sums[layer] / 80).numpy()
        np.testing.assert_allclose(means.k[layer], expected[0], atol=1e-5)
        np.testing.assert_allclose(means.v[layer], expected[1], atol=1e-5)
        np.testing.assert_allclose(means.k_amax[layer], amaxes[layer][0].numpy(), rtol=1e-6)
        np.testing.assert_allclose(means.v_amax[layer], amaxes[layer][1].numpy(), rtol=1e-6)
    assert np.abs(means.k[0]).max() > 0 and means.k_amax[0].min() > np.abs(means.k[0]).max()
    k_scales, v_scales = means.fp8_scales()  # each layer's amax over its heads lands on E4M3's 448
    assert k_scales == [float(a.max()) / 448 for a in means.k_amax] and v_scales == [float(a.max()) / 448
                                                                                     for a in means.v_amax]
