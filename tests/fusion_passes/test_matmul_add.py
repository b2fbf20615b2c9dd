from __future__ import annotations

import numpy as np
import pytest
from graphs import FLOAT, apply, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.matmul_add import fuse_matmul_add

RNG = np.random.default_rng(0)
W = RNG.standard_normal((8, 4)).astype(np.float32)
B = RNG.standard_normal(4).astype(np.float32)


def _linear(shape, *, bias_first: bool, bias=B):
    add_inputs = ["b", "y"] if bias_first else ["y", "b"]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", add_inputs, ["z"])]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, shape)],
        [helper.make_tensor_value_info("z", FLOAT, [*shape[:-1], 4])],
        [("w", W), ("b", bias)],
    )


@pytest.mark.parametrize("bias_first", [False, True])
def test_3d_linear_becomes_trtopt_matmul_add(bias_first):
    proto = _linear(["B", "T", 8], bias_first=bias_first)
    count, fused = apply(proto, fuse_matmul_add)
    assert count == 1
    assert op_types(fused) == ["MatMulAdd"]
    assert fused.graph.node[0].domain == "trtopt"
    x = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(proto, {"x": x})[0], atol=1e-5)


def test_2d_linear_becomes_gemm():
    proto = _linear([3, 8], bias_first=True)
    count, fused = apply(proto, fuse_matmul_add)
    assert count == 1 and op_types(fused) == ["Gemm"]
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(proto, {"x": x})[0], atol=1e-5)


def test_residual_add_is_left_alone():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "r"], ["z"])]
    proto = model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [2, 3, 8]), helper.make_tensor_value_info("r", FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("z", FLOAT, [2, 3, 4])],
        [("w", W)],
    )
    count, fused = apply(proto, fuse_matmul_add)
    assert count == 0 and op_types(fused) == ["MatMul", "Add"]


def test_bias_of_the_wrong_width_is_left_alone():
    proto = _linear(["B", "T", 8], bias_first=False, bias=np.ones((3, 4), np.float32))
    assert apply(proto, fuse_matmul_add)[0] == 0
