"""GeluMul, face 1 of docs/architecture.md §4.

Inputs: gate [..., N], up [..., N] (one float dtype, the same shape). Output: y = gelu(gate) · up, the inputs' shape
and dtype. Attribute ``tanh`` (int, required): 1 for GELU's tanh approximation
0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))) (torch / ONNX ``approximate="tanh"``), 0 for the exact
0.5·g·(1 + erf(g/√2)).

Why an int and not ONNX Gelu's ``approximate`` string: the function body must choose between the two forms from the
attribute, and below opset 19 (our exports are 17/18) no ONNX op compares strings; an int becomes a bool through
``Equal``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape, gated_shape

OP_TYPE = "GeluMul"
INPUTS = ("gate", "up")
OUTPUTS = ("y",)

# The GELU's constants, for the rule that recognises them, the body, the reference and the kernel.
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # tanh form: tanh(√(2/π)·(g + KAPPA·g³))
KAPPA = 0.044715
SQRT_2 = math.sqrt(2.0)  # erf form: erf(g / √2)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    if attrs["tanh"] not in (0, 1):
        raise BuildError(f"{OP_TYPE}: attribute tanh is {attrs['tanh']}; it must be 1 (tanh approximation) or 0 "
                         "(exact erf GELU). Fix the rule or the hand-written node.")
    return gated_shape(OP_TYPE, shapes[0], shapes[1])


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # TensorRT fuses the body's pointwise ops into one kernel on its own
    outputs=OUTPUTS,
    attributes=(AttrSpec("tanh", int, doc="1: GELU's tanh approximation; 0: the exact erf GELU"),),
    infer_shapes=infer_shapes,
)
