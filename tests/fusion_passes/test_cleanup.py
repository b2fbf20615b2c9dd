from __future__ import annotations

import numpy as np
import onnx_ir as ir
from graphs import FLOAT, apply, const, model, run
from onnx import helper

from trtopt.fusion_passes.cleanup import cleanup


def test_folds_constants_and_drops_dead_nodes():
    """A legacy-style scale computed from Constant nodes becomes one initializer; an unused branch disappears."""
    nodes = [
        const("d", np.float32(16.0)),
        helper.make_node("Sqrt", ["d"], ["sqrt_d"]),
        helper.make_node("Div", ["x", "sqrt_d"], ["y"]),
        helper.make_node("Relu", ["x"], ["dead"]),
    ]
    proto = model(
        nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])], [helper.make_tensor_value_info("y", FLOAT, [2, 3])]
    )
    removed, cleaned = apply(proto, cleanup)
    assert removed == 3
    assert [n.op_type for n in cleaned.graph.node] == ["Div"]
    divisor = ir.from_proto(cleaned).graph.node(0).inputs[1]
    assert float(divisor.const_value.numpy()) == 4.0
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(run(cleaned, {"x": x})[0], run(proto, {"x": x})[0])
