"""SiluMul, face 2 of docs/architecture.md §4: the body is the exported ops it replaces, Sigmoid → Mul → Mul."""

from __future__ import annotations

import onnx

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.silu_mul.schema import INPUTS, OP_TYPE, OUTPUTS


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    b.op("Mul", b.op("Mul", "gate", b.op("Sigmoid", "gate")), "up", name="y")
    return b.function(OP_TYPE, INPUTS, OUTPUTS, [], doc="silu(gate) * up; see trtopt/plugins/silu_mul/schema.py.")
