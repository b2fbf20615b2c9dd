"""GeluMul, face 2 of docs/architecture.md §4: the body is the exported ops it replaces, for either form, chosen by
``tanh``.

At opset ≥ 20 each form is one standard Gelu; below, the ops the dynamo exporter decomposes it into. A function body
cannot branch on an attribute without a subgraph, so both forms are written and ``Where(tanh == 1, ·, ·)`` picks
one. TensorRT's pointwise fusion takes the Where with the rest (the unused form is then register arithmetic in a
memory-bound kernel, if the constant condition is not folded away first); onnxruntime evaluates both forms, a few
extra pointwise ops per layer on a path that is not the CPU serving path (the torch executor runs the reference).
"""

from __future__ import annotations

import onnx

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.gelu_mul.schema import INPUTS, KAPPA, OP_TYPE, OUTPUTS, SCHEMA, SQRT_2, SQRT_2_OVER_PI


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)

    def const(value: float) -> str:
        return b.op("CastLike", b.float_scalar(value), "gate")

    if opset >= 20:
        tanh_form = b.op("Gelu", "gate", approximate="tanh")
        erf_form = b.op("Gelu", "gate")
    else:
        cube = b.op("Pow", "gate", const(3.0))
        inner = b.op("Mul", const(SQRT_2_OVER_PI), b.op("Add", "gate", b.op("Mul", const(KAPPA), cube)))
        tanh_form = b.op("Mul", "gate", b.op("Mul", const(0.5), b.op("Add", b.op("Tanh", inner), const(1.0))))
        erf = b.op("Erf", b.op("Div", "gate", const(SQRT_2)))
        erf_form = b.op("Mul", "gate", b.op("Mul", const(0.5), b.op("Add", erf, const(1.0))))
    is_tanh = b.op("Equal", b.attr("tanh", int), b.int_scalar(1))
    b.op("Mul", b.op("Where", is_tanh, tanh_form, erf_form), "up", name="y")
    return b.function(OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes],
                      doc="gelu(gate) * up (tanh=1: tanh approximation); see trtopt/plugins/gelu_mul/schema.py.")
