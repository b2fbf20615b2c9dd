from __future__ import annotations

import numpy as np
import pytest
from graphs import FLOAT, apply, const, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.layer_norm import fuse_layer_norm

RNG = np.random.default_rng(2)
GAMMA = RNG.standard_normal(16).astype(np.float32)
BETA = RNG.standard_normal(16).astype(np.float32)


def _mean(opset, x, out, axes_name):
    if opset >= 18:
        return [helper.make_node("ReduceMean", [x, axes_name], [out], keepdims=1)]
    return [helper.make_node("ReduceMean", [x], [out], axes=[-1], keepdims=1)]


def _layer_norm_graph(opset: int, *, square_by_mul: bool):
    nodes = [const("axes", np.array([-1], np.int64)), const("two", np.float32(2.0)), const("eps", np.float32(1e-5))]
    nodes += _mean(opset, "x", "mean", "axes")
    nodes += [helper.make_node("Sub", ["x", "mean"], ["d"])]
    nodes += [
        helper.make_node("Mul", ["d", "d"], ["dd"]) if square_by_mul else helper.make_node("Pow", ["d", "two"], ["dd"])
    ]
    nodes += _mean(opset, "dd", "var", "axes")
    nodes += [
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["d", "std"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["ns"]),
        helper.make_node("Add", ["ns", "b"], ["y"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, ["B", "T", 16])],
        [helper.make_tensor_value_info("y", FLOAT, ["B", "T", 16])],
        [("g", GAMMA), ("b", BETA)],
        opset=opset,
    )


@pytest.mark.parametrize("opset,square_by_mul", [(17, False), (18, True)])
def test_decomposed_layer_norm_fuses(opset, square_by_mul):
    proto = _layer_norm_graph(opset, square_by_mul=square_by_mul)
    count, fused = apply(proto, fuse_layer_norm)
    assert count == 1
    assert [t for t in op_types(fused) if t != "Constant"] == ["LayerNormalization"]
    x = RNG.standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(proto, {"x": x})[0], atol=1e-5)


def test_below_opset_17_is_left_alone():
    proto = _layer_norm_graph(17, square_by_mul=False)
    proto.opset_import[0].version = 16
    assert apply(proto, fuse_layer_norm)[0] == 0
