"""AddRMSNorm, face 2 of docs/architecture.md §4: the body is the Add it absorbed, then trtopt::RMSNorm's body on the
sum."""

from __future__ import annotations

import onnx
from onnx import TensorProto

from trtopt.plugins.add_rms_norm.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA
from trtopt.plugins.common import BodyBuilder


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    s = b.op("Add", "x", "residual", name="sum")
    s32 = b.op("Cast", s, to=TensorProto.FLOAT)
    square = b.op("Mul", s32, s32)
    # ReduceMean took its axes as an attribute up to opset 17 and as an input from 18 on.
    if opset >= 18:
        mean = b.op("ReduceMean", square, b.ints(-1), keepdims=1)
    else:
        mean = b.op("ReduceMean", square, axes=[-1], keepdims=1)
    inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", mean, b.attr("epsilon", float))))
    normalized = b.op("CastLike", b.op("Mul", s32, inv_rms), "scale")  # scale's dtype: schema.py
    b.op("Mul", "scale", normalized, name="y")
    return b.function(
        OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes],
        doc="y = RMSNorm(x + residual), sum = x + residual; see trtopt/plugins/add_rms_norm/schema.py.",
    )
