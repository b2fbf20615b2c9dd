from __future__ import annotations

import numpy as np
import pytest
from graphs import FLOAT, apply, const, model, op_types, run
from onnx import TensorProto, helper

from trtopt.fusion_passes.rms_norm import fuse_rms_norm

RNG = np.random.default_rng(1)
SCALE = RNG.standard_normal(16).astype(np.float32)


def _rms_graph(opset: int, *, reciprocal: bool, weight_first: bool):
    """HF LlamaRMSNorm as the exporters write it (axes as input from opset 18, as attribute before)."""
    nodes = [
        const("two", np.float32(2.0)),
        const("eps", np.float32(1e-6)),
        const("one", np.float32(1.0)),
        helper.make_node("Pow", ["x", "two"], ["sq"]),
    ]
    if opset >= 18:
        nodes += [
            const("axes", np.array([-1], np.int64)),
            helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        ]
    else:
        nodes += [helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1)]
    nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"])]
    nodes += [
        helper.make_node("Reciprocal", ["rms"], ["inv"])
        if reciprocal
        else helper.make_node("Div", ["one", "rms"], ["inv"])
    ]
    nodes += [
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"] if weight_first else ["normed", "w"], ["y"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, ["B", "T", 16])],
        [helper.make_tensor_value_info("y", FLOAT, ["B", "T", 16])],
        [("w", SCALE)],
        opset=opset,
    )


@pytest.mark.parametrize("opset,reciprocal,weight_first", [(18, True, True), (17, False, True), (18, True, False)])
def test_below_opset_23_becomes_trtopt_rms_norm(opset, reciprocal, weight_first):
    proto = _rms_graph(opset, reciprocal=reciprocal, weight_first=weight_first)
    count, fused = apply(proto, fuse_rms_norm)
    assert count == 1
    kept = [t for t in op_types(fused) if t != "Constant"]
    assert kept == ["RMSNorm"]
    x = RNG.standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(proto, {"x": x})[0], atol=1e-5)


def test_opset_23_becomes_standard_rms_normalization():
    proto = _rms_graph(23, reciprocal=True, weight_first=True)
    count, fused = apply(proto, fuse_rms_norm)
    assert count == 1
    assert [t for t in op_types(fused) if t != "Constant"] == ["RMSNormalization"]
    x = RNG.standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(proto, {"x": x})[0], atol=1e-5)


def test_mean_over_another_axis_is_left_alone():
    proto = _rms_graph(18, reciprocal=True, weight_first=True)
    for node in proto.graph.node:
        if node.output[0] == "axes":
            node.attribute[0].t.CopyFrom(helper.make_tensor("axes", 7, [1], [1]))
    assert apply(proto, fuse_rms_norm)[0] == 0


def _half_graph(weight_before_downcast: bool):
    """HF's fp16 norms: Llama scales after the downcast by an fp16 weight (``w * normed.to(fp16)``); Gemma / Gemma-3
    scale before it by an fp32 weight (``(normed * (1 + w.float())).type_as(x)``)."""
    nodes = [const("two", np.float32(2.0)), const("eps", np.float32(1e-6)), const("axes", np.array([-1], np.int64)),
             helper.make_node("Cast", ["x"], ["x32"], to=FLOAT), helper.make_node("Pow", ["x32", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["x32", "inv"], ["normed"])]
    if weight_before_downcast:
        nodes += [helper.make_node("Mul", ["normed", "w"], ["scaled"]),
                  helper.make_node("Cast", ["scaled"], ["y"], to=TensorProto.FLOAT16)]
        weight = (1 + SCALE).astype(np.float32)
    else:
        nodes += [helper.make_node("Cast", ["normed"], ["n16"], to=TensorProto.FLOAT16),
                  helper.make_node("Mul", ["w", "n16"], ["y"])]
        weight = SCALE.astype(np.float16)
    half = TensorProto.FLOAT16
    return model(nodes, [helper.make_tensor_value_info("x", half, ["B", "T", 16])],
                 [helper.make_tensor_value_info("y", half, ["B", "T", 16])], [("w", weight)])


@pytest.mark.parametrize("gemma", [False, True], ids=["llama-fp16", "gemma-fp16"])
def test_half_precision_norms_fuse_with_the_original_rounding(gemma):
    """Llama's form fuses from the fp16 input (the op does the fp32 math and the fp16 scale, as HF does); Gemma's fp32
    weight cannot meet an fp16 input, so its norm is fused in fp32 between the exported Casts: the same math."""
    proto = _half_graph(weight_before_downcast=gemma)
    count, fused = apply(proto, fuse_rms_norm)
    assert count == 1
    kept = [t for t in op_types(fused) if t != "Constant"]
    assert kept == (["Cast", "RMSNorm", "Cast"] if gemma else ["RMSNorm"])
    x = (4 * RNG.standard_normal((2, 5, 16))).astype(np.float16)
    got, want = run(fused, {"x": x})[0], run(proto, {"x": x})[0]
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_array_max_ulp(got, want, maxulp=1)
