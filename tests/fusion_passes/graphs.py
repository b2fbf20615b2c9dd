"""Tiny hand-written graphs for the per-pass tests, and an ORT comparison helper."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

FLOAT = TensorProto.FLOAT


def model(nodes, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    from trtopt.plugins import attach_functions

    proto = attach_functions(proto)
    onnx.checker.check_model(proto, full_check=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def apply(proto: onnx.ModelProto, rule) -> tuple[int, onnx.ModelProto]:
    """Run one rule on a copy of ``proto``; returns (count, rewritten proto)."""
    m = ir.from_proto(proto)
    count = rule(m)
    return count, ir.to_proto(m)


def op_types(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]
