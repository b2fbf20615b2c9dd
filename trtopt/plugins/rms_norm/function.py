"""RMSNorm, face 2 of docs/architecture.md §4: the ONNX function body (the same ops the exporters decompose it into)."""

from __future__ import annotations

import onnx
from onnx import TensorProto

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.rms_norm.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    x = b.op("Cast", "x", to=TensorProto.FLOAT)
    square = b.op("Mul", x, x)
    # ReduceMean took its axes as an attribute up to opset 17 and as an input from 18 on.
    if opset >= 18:
        mean = b.op("ReduceMean", square, b.ints(-1), keepdims=1)
    else:
        mean = b.op("ReduceMean", square, axes=[-1], keepdims=1)
    inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", mean, b.attr("epsilon", float))))
    normalized = b.op("CastLike", b.op("Mul", x, inv_rms), "x")
    b.op("Mul", "scale", normalized, name="y")
    return b.function(
        OP_TYPE,
        INPUTS,
        OUTPUTS,
        [a.name for a in SCHEMA.attributes],
        doc="RMSNorm over the last axis; see trtopt/plugins/rms_norm/schema.py.",
    )
