"""kv_rotation: MatMul(q, H) and MatMul(k, H) before every PagedAttention. H is orthonormal, so on float32 pools the
attention outputs and logits of the rotated tiny Llama plan equal the plan's on onnxruntime (the pass is applied to a
plan with model-dtype pools here, which the build does not allow: it is exact there and pays only with FP8)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from trtopt.builder.plan import MODEL_FILE, read_plan
from trtopt.fusion_passes.kv_rotation import INITIALIZER_PREFIX, _rotation, hadamard, rotate_qk
from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.executors.ort_executor import OrtExecutor
from trtopt.runtime.input_builder import InputBuilder

MODEL = "tiny-llama"  # head_dim 16


@pytest.mark.parametrize("d", [1, 2, 4, 16, 32, 64, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(d):
    h = hadamard(d)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    assert np.array_equal(h, h.T) and np.allclose(np.abs(h), 1 / np.sqrt(d))


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16])
@pytest.mark.parametrize("d", [16, 32, 128])
def test_a_rounded_h_is_alpha_times_h_and_alpha_squared_is_returned(d, dtype):
    """Every entry of H rounds alike, so the stored matrix is exactly alpha·H; the scores grow by alpha², which
    rotate_qk divides out of the node's scale (alpha = 1 where 1/sqrt(d) is a power of two)."""
    graph = ir.Graph([], [], nodes=[])
    value, factor = _rotation(graph, d, dtype, {})
    stored = value.const_value.numpy().astype(np.float64)
    alpha = np.sqrt(factor)
    np.testing.assert_array_equal(stored, alpha * hadamard(d))
    assert (factor == 1.0) == (d in (16, 64, 256))
    assert abs(factor - 1.0) < 3e-4 and value.name.startswith(INITIALIZER_PREFIX + str(d))


def _marked(plan_dir, out, *, rotate: bool, values: bool = False) -> tuple[object, int]:
    """A copy of the plan whose graph also outputs every PagedAttention's attention output; rotated when asked (with
    ``values``, q, k and v, and the output marked is the rotated-back one that the graph's readers see). Returns
    (plan dir, layers rotated)."""
    proto = onnx.load(str(plan_dir / MODEL_FILE))
    model = ir.from_proto(proto)
    rotated = rotate_qk(model, values=values) if rotate else 0
    proto = ir.to_proto(model)
    for node in proto.graph.node:
        if node.name.endswith(".rotate_back_v") if values else node.op_type == "PagedAttention":
            proto.graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
    out.mkdir()
    onnx.save(proto, str(out / MODEL_FILE))
    shutil.copy(plan_dir / "plan.json", out / "plan.json")
    return out, rotated


def test_rotation_on_float32_pools_leaves_attention_and_logits_unchanged_on_onnxruntime(plan_dir, tmp_path):
    source = plan_dir(MODEL)
    plan = read_plan(source)
    assert plan.model.head_dim == 16 and plan.kv_pool_dtype == "float32"
    base, _ = _marked(source, tmp_path / "base", rotate=False)
    rot, count = _marked(source, tmp_path / "rot", rotate=True)
    assert count == plan.model.num_layers

    graph = onnx.load(str(rot / MODEL_FILE), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    (init,) = [t for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)]  # one H for every layer
    for node in (n for n in graph.node if n.op_type == "PagedAttention"):
        q, k, v = (produced_by.get(name) for name in node.input[:3])
        assert q.op_type == k.op_type == "MatMul" and q.input[1] == k.input[1] == init.name
        assert v is None or v.op_type != "MatMul" or v.input[1] != init.name  # V is not rotated
        assert produced_by[q.input[0]].op_type == produced_by[k.input[0]].op_type == "Rope"
    assert [a.f for n in graph.node if n.op_type == "PagedAttention" for a in n.attribute if a.name == "scale"] \
        == [0.25] * plan.model.num_layers  # 1/sqrt(16): H = ±1/4 is exact, the scale is unchanged

    executors = {name: OrtExecutor(d, plan) for name, d in (("base", base), ("rot", rot))}
    for ex in executors.values():
        ex.allocate_kv_cache(8)
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 5000, 40)]
    steps = [ScheduledBatch([ScheduledSeq("a", tokens[:37], 0, [1, 2, 3], True,
                                          prompt_logprob_positions=range(37))], 37, [])]
    steps += [ScheduledBatch([ScheduledSeq("a", [tokens[i]], i, [1, 2, 3], True)], 1, []) for i in range(37, 40)]
    for batch in steps:  # a prefill over three blocks, then decode steps reading the rotated keys back
        inputs = builder.build(batch)
        logits = {name: ex.execute(inputs).numpy() for name, ex in executors.items()}
        np.testing.assert_allclose(logits["rot"], logits["base"], rtol=0, atol=1e-5)
        extras = {name: ex.extra_outputs for name, ex in executors.items()}
        assert len(extras["base"]) == plan.model.num_layers
        for name, out in extras["base"].items():
            np.testing.assert_allclose(extras["rot"][name].numpy(), out.numpy(), rtol=0, atol=1e-5)
    # The pools differ in K (it is stored rotated) and agree in V.
    pools = {name: ex.kv_caches[0] for name, ex in executors.items()}
    k_base, k_rot = pools["base"][:, 0], pools["rot"][:, 0]
    assert not np.allclose(k_rot, k_base, atol=1e-3)
    np.testing.assert_allclose(k_rot, k_base @ hadamard(16).astype(np.float32), atol=1e-5)
    np.testing.assert_allclose(pools["rot"][:, 1], pools["base"][:, 1], atol=1e-5)


def test_rotate_qk_divides_the_rounding_out_of_the_scale():
    """fp16 at head_dim 32: H's entries round to alpha/sqrt(32), so the node's scale is divided by alpha²."""
    from trtopt.plugins.common import DOMAIN

    d, scale = 32, 1 / np.sqrt(32)
    q, k, v = (ir.Value(name=n, shape=ir.Shape([1, 2, "T", d]), type=ir.TensorType(ir.DataType.FLOAT16))
               for n in "qkv")
    attrs = [ir.AttrInt64("head_dim", d), ir.AttrFloat32("scale", scale)]
    node = ir.Node(DOMAIN, "PagedAttention", [q, k, v], attrs, num_outputs=2, name="PagedAttention_0")
    model = ir.Model(ir.Graph([q, k, v], node.outputs, nodes=[node]), ir_version=10)
    assert rotate_qk(model) == 1
    _, factor = _rotation(ir.Graph([], [], nodes=[]), d, ir.DataType.FLOAT16, {})
    assert factor != 1.0
    np.testing.assert_allclose(node.attributes["scale"].value, scale / factor, rtol=1e-7)
    assert [n.op_type for n in model.graph] == ["MatMul", "MatMul", "PagedAttention"]
    assert node.inputs[2] is v and node.inputs[0].dtype == ir.DataType.FLOAT16


def test_value_rotation_leaves_attention_and_logits_unchanged_on_onnxruntime(plan_dir, tmp_path):
    """`hadamard_kv`: v·H stored and the output times H: on float32 pools the attention outputs (after the rotation
    back) and the logits equal the unrotated plan's; both pool halves hold rotated values."""
    source = plan_dir(MODEL)
    plan = read_plan(source)
    base, _ = _marked(source, tmp_path / "base", rotate=False)
    rot, count = _marked(source, tmp_path / "rot", rotate=True, values=True)
    assert count == plan.model.num_layers
    graph = onnx.load(str(rot / MODEL_FILE), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for node in (n for n in graph.node if n.op_type == "PagedAttention"):
        assert [produced_by[name].op_type for name in node.input[:3]] == ["MatMul"] * 3
        assert [r.name for r in readers[node.output[0]]] == [f"{node.name}.rotate_back_v"]  # nothing else reads it

    executors = {name: OrtExecutor(d, plan) for name, d in (("base", base), ("rot", rot))}
    for ex in executors.values():
        ex.allocate_kv_cache(8)
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 5000, 36)]
    steps = [ScheduledBatch([ScheduledSeq("a", tokens[:33], 0, [1, 2, 3], True)], 33, [])]
    steps += [ScheduledBatch([ScheduledSeq("a", [tokens[i]], i, [1, 2, 3], True)], 1, []) for i in range(33, 36)]
    for batch in steps:
        inputs = builder.build(batch)
        logits = {name: ex.execute(inputs).numpy() for name, ex in executors.items()}
        np.testing.assert_allclose(logits["rot"], logits["base"], rtol=0, atol=1e-5)
        base_out = list(executors["base"].extra_outputs.values())
        rot_out = list(executors["rot"].extra_outputs.values())
        assert len(base_out) == len(rot_out) == plan.model.num_layers
        for a, b in zip(rot_out, base_out):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)
    h = hadamard(16).astype(np.float32)
    pools = {name: ex.kv_caches[0] for name, ex in executors.items()}
    for half in (0, 1):  # K and V both stored rotated
        np.testing.assert_allclose(pools["rot"][:, half], pools["base"][:, half] @ h, atol=1e-5)


def test_value_rotation_divides_the_rounding_out_of_the_output():
    """fp16 at head_dim 32: the rotated-back output is multiplied by 1/alpha² (the stored H is alpha·H)."""
    from trtopt.plugins.common import DOMAIN

    d = 32
    q, k, v = (ir.Value(name=n, shape=ir.Shape([1, 2, "T", d]), type=ir.TensorType(ir.DataType.FLOAT16))
               for n in "qkv")
    attrs = [ir.AttrInt64("head_dim", d), ir.AttrFloat32("scale", 0.1)]
    node = ir.Node(DOMAIN, "PagedAttention", [q, k, v], attrs, num_outputs=2, name="PagedAttention_0")
    node.outputs[0].dtype = ir.DataType.FLOAT16
    out = node.outputs[0]
    model = ir.Model(ir.Graph([q, k, v], [out], nodes=[node]), ir_version=10)
    assert rotate_qk(model, values=True) == 1
    assert [n.op_type for n in model.graph] == ["MatMul", "MatMul", "MatMul", "PagedAttention", "MatMul", "Mul"]
    _, factor = _rotation(ir.Graph([], [], nodes=[]), d, ir.DataType.FLOAT16, {})
    mul = list(model.graph)[-1]
    assert model.graph.outputs[0] is mul.outputs[0]  # the graph output now reads the rotated-back value
    np.testing.assert_allclose(float(mul.inputs[1].const_value.numpy()), 1 / factor, rtol=1e-3)
