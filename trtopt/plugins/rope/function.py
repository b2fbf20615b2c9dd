"""Rope, face 2 of docs/architecture.md §4: the body is the exported subgraph it replaces (two Slices, Neg, Concat,
Mul, Mul,
Add), with the split point taken from the ``half`` attribute or, when it is 0, from x's last dimension."""

from __future__ import annotations

import onnx

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.rope.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA

_END = 2**63 - 1  # "to the end", as the exporters write it


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    half_attr = b.op("Unsqueeze", b.attr("half", int), b.ints(0))  # [1]
    last = b.op("Shape", "x", start=-1)  # [D]
    half = b.op("Where", b.op("Greater", half_attr, b.ints(0)), half_attr, b.op("Div", last, b.ints(2)))
    axis = b.ints(-1)
    lo = b.op("Slice", "x", b.ints(0), half, axis)
    hi = b.op("Slice", "x", half, b.ints(_END), axis)
    rotated = b.op("Concat", b.op("Neg", hi), lo, axis=-1)
    b.op("Add", b.op("Mul", "x", "cos"), b.op("Mul", rotated, "sin"), name="y")
    return b.function(OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes],
                      doc="x*cos + rotate_half(x)*sin; see trtopt/plugins/rope/schema.py.")
