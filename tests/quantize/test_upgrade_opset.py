"""`trtopt quantize` lifts an export to the opset its Q/DQ ops need (quantize/graph.py `upgrade_opset`). The version
converter serializes the whole model, which protobuf refuses past 2 GiB (a ~1.2B-parameter bf16 export failed so on
an H200 in session 25), so the large weights leave the proto while it runs and come back by name."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trtopt.quantize import graph


def _model(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)  # 8 KiB: detached
    shape = np.array([1, 32], dtype=np.int64)  # 16 bytes: stays in place
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "shape"], ["y"], name="reshape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(shape, "shape")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_upgrade_keeps_every_weight_and_the_input_model():
    model = _model(18)
    before = {i.name: numpy_helper.to_array(i).copy() for i in model.graph.initializer}
    lifted = graph.upgrade_opset(model, 21)
    assert graph.opset_of(lifted) == 21
    for m in (lifted, model):  # the input model gets its weights back too
        got = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        assert got.keys() == before.keys()
        for name, value in before.items():
            np.testing.assert_array_equal(got[name], value)
        assert all(i.data_location == TensorProto.DEFAULT and not i.external_data for i in m.graph.initializer)
    onnx.checker.check_model(lifted)


def test_upgrade_detaches_only_large_weights(monkeypatch):
    seen = {}
    import onnx.version_converter as vc

    real = vc.convert_version
    monkeypatch.setattr(vc, "convert_version", lambda m, o: (seen.update(
        {i.name: (len(i.raw_data), i.data_location) for i in m.graph.initializer}), real(m, o))[1])
    graph.upgrade_opset(_model(18), 21)
    assert seen["W"] == (0, TensorProto.EXTERNAL)  # the converter never saw the weight's bytes
    assert seen["shape"] == (16, TensorProto.DEFAULT)


def test_no_upgrade_returns_the_model_itself():
    model = _model(21)
    assert graph.upgrade_opset(model, 21) is model
