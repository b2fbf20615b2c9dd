"""ir_helpers.infer_missing_shapes: onnxruntime's symbolic shape inference, used where a proof needs shapes."""

from __future__ import annotations

import onnx_ir as ir
from onnx import TensorProto, helper

from trtopt.fusion_passes.ir_helpers import infer_missing_shapes


def test_incomplete_shape_inference_leaves_nothing_in_the_working_directory(tmp_path, monkeypatch):
    """ORT's inference saves sym_shape_infer_temp.onnx (+ a .data file) into the working directory before it gives
    up on a graph it cannot follow (here an op of an unknown domain); a build used to leave both behind, and two
    such files were committed to this repository from a test run in its root."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Mystery", ["x"], ["y"], domain="example.unknown"),
                               helper.make_node("Relu", ["y"], ["z"])], "g", [x], [z])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("example.unknown", 1)])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert infer_missing_shapes(ir.from_proto(proto)) == 0
    assert list(cwd.iterdir()) == []
