"""SiluMul, face 1 of docs/architecture.md §4.

Inputs: gate [..., N], up [..., N] (one float dtype, the same shape). Output: y = gate · sigmoid(gate) · up, the
inputs' shape and dtype. No attributes besides the TensorRT ones every trtopt node carries. Each product is
rounded to the inputs' dtype, as in the exported graph it replaces (Sigmoid → Mul → Mul).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.plugins.common import OpSchema, Shape, gated_shape

OP_TYPE = "SiluMul"
INPUTS = ("gate", "up")
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    return gated_shape(OP_TYPE, shapes[0], shapes[1])


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # TensorRT fuses the body's Sigmoid·Mul·Mul into one pointwise kernel on its own
    outputs=OUTPUTS,
    attributes=(),
    infer_shapes=infer_shapes,
)
