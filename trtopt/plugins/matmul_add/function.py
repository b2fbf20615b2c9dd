"""MatMulAdd, face 2 of docs/architecture.md §4: the body is literally MatMul → Add, the pair it replaces."""

from __future__ import annotations

import onnx

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.matmul_add.schema import INPUTS, OP_TYPE, OUTPUTS


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    b.op("Add", b.op("MatMul", "x", "weight"), "bias", name="y")
    return b.function(OP_TYPE, INPUTS, OUTPUTS, [], doc="x @ weight + bias; see trtopt/plugins/matmul_add/schema.py.")
