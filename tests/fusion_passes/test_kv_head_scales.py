"""kv_head_scales: Mul(k, c_k), Mul(v, c_v) per KV head before every PagedAttention, Mul(q, 1/c_k) and Mul(out, 1/c_v)
per query head around it, c powers of two. Exact in floating point, so on float32 pools the tiny Llama plan rewritten
with arbitrary factors gives the plan's logits bit for bit on onnxruntime, and its pools hold exactly k·c_k and v·c_v
(the pass is applied to a plan with model-dtype pools here, which the build does not allow: there it pays only with
FP8). KvStats.head_factors is checked on hand-made amaxes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from test_kv_smoothing import _rewritten, _steps
from trtopt.builder.kv_calibration import KvStats
from trtopt.builder.plan import MODEL_FILE, read_plan
from trtopt.fusion_passes.kv_head_scales import INITIALIZER_PREFIX, scale_kv_heads
from trtopt.fusion_passes.kv_rotation import rotate_qk
from trtopt.fusion_passes.kv_smoothing import smooth_kv
from trtopt.runtime.executors.ort_executor import OrtExecutor

MODEL = "tiny-llama"  # 4 query heads on 2 KV heads of 16


@pytest.mark.parametrize("transforms", [False, True], ids=["plain", "smoothed_rotated"])
def test_head_factors_on_float32_pools_leave_the_logits_bit_for_bit_on_onnxruntime(plan_dir, tmp_path, transforms):
    source = plan_dir(MODEL)
    plan = read_plan(source)
    layers, hkv = plan.model.num_layers, plan.model.num_kv_heads
    assert plan.kv_pool_dtype == "float32" and plan.model.num_heads == 2 * hkv
    rng = np.random.default_rng(3)
    c_k = [np.exp2(rng.integers(0, 5, hkv)).astype(float) for _ in range(layers)]
    c_v = [np.exp2(rng.integers(0, 5, hkv)).astype(float) for _ in range(layers)]
    c_k[0][:] = 1.0  # layer 0 scales only v; the last layer both
    c_v[0][0], c_v[0][1] = 1.0, 8.0

    def before(model):  # the build's order: smoothing in fuse, the rotation after sharding, the head factors last
        if transforms:
            means = [rng.standard_normal((hkv, plan.model.head_dim)) for _ in range(layers)]
            smooth_kv(model, means, means)
            rotate_qk(model, values=True)

    def rewrite(model):
        before(model)
        assert scale_kv_heads(model, c_k, c_v) == layers

    rng_state = rng.bit_generator.state
    scaled = _rewritten(source, tmp_path / "scaled", rewrite)
    rng.bit_generator.state = rng_state  # the same means for the base
    base = _rewritten(source, tmp_path / "base", before)
    graph = onnx.load(str(scaled / MODEL_FILE), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for layer, node in enumerate(n for n in graph.node if n.op_type == "PagedAttention"):
        for index, what in ((0, "q"), (1, "k"), (2, "v")):
            mul = produced_by[node.input[index]]
            scaled_here = what == "v" or layer > 0
            assert (mul.op_type == "Mul" and mul.input[1] == f"{INITIALIZER_PREFIX}{what}_{layer}") == scaled_here
        np.testing.assert_array_equal(inits[f"{INITIALIZER_PREFIX}v_{layer}"].ravel(), c_v[layer])
        np.testing.assert_array_equal(inits[f"{INITIALIZER_PREFIX}out_{layer}"].ravel(), 1 / np.repeat(c_v[layer], 2))
    assert f"{INITIALIZER_PREFIX}q_0" not in inits
    np.testing.assert_array_equal(inits[f"{INITIALIZER_PREFIX}q_{layers - 1}"].ravel(), 1 / np.repeat(c_k[-1], 2))

    executors = {name: OrtExecutor(d, plan) for name, d in (("base", base), ("scaled", scaled))}
    for ex in executors.values():
        ex.allocate_kv_cache(8)
    for inputs in _steps(plan):
        logits = {name: ex.execute(inputs).numpy() for name, ex in executors.items()}
        np.testing.assert_array_equal(logits["scaled"], logits["base"])
    for layer in range(layers):  # [blocks, 2 (K, V), Hkv, 16, D]: the written blocks 1..3 hold k·c_k and v·c_v
        pools = {name: np.asarray(ex.kv_caches[layer])[1:4] for name, ex in executors.items()}
        for kv, c in ((0, c_k[layer]), (1, c_v[layer])):
            np.testing.assert_array_equal(pools["scaled"][:, kv], pools["base"][:, kv] * c[None, :, None, None])


def test_head_factors_bring_every_head_within_2x_of_the_layer_amax():
    k_amax = [np.array([8.0, 1.0, 3.0, 0.0]), np.array([0.5, 0.5, 0.5, 0.5])]
    v_amax = [np.array([0.3, 2.4, 2.5, 1.2]), np.zeros(4)]
    stats = KvStats(k=[], v=[], k_amax=k_amax, v_amax=v_amax, tokens=1, windows=1, device="cpu", seconds=0.0)
    k, v = stats.head_factors()
    np.testing.assert_array_equal(k[0], [1, 8, 2, 1])  # 8 exactly on the layer amax; an all-zero head keeps 1
    np.testing.assert_array_equal(k[1], [1, 1, 1, 1])
    np.testing.assert_array_equal(v[0], [8, 1, 1, 2])  # 0.3 x 8 = 2.4 <= 2.5; 1.2 x 2 = 2.4
    np.testing.assert_array_equal(v[1], [1, 1, 1, 1])
    for amax, factors in zip(k_amax + v_amax, k + v):
        scaled = amax * factors
        assert scaled.max() == amax.max() and (scaled[amax > 0] > amax.max() / 2).all()
    assert stats.fp8_scales() == ([1 / 56, 0.5 / 448], [2.5 / 448, 1.0])  # the layer's amax, or 1.0 for zeros


def test_factors_that_are_not_powers_of_two_are_refused(plan_dir):
    import onnx_ir as ir

    source = plan_dir(MODEL)
    plan = read_plan(source)
    model = ir.from_proto(onnx.load(str(source / MODEL_FILE)))
    ones = [np.ones(plan.model.num_kv_heads)] * plan.model.num_layers
    assert scale_kv_heads(model, ones, ones) == 0  # all ones: nothing to rewrite
    with pytest.raises(AssertionError, match="not powers of two"):
        scale_kv_heads(model, [np.full(plan.model.num_kv_heads, 3.0)] * plan.model.num_layers, ones)
