"""AddRMSNorm, face 1 of docs/architecture.md §4.

Inputs: x, residual (one float dtype; broadcast like ONNX Add, in practice both [..., H]), scale [H].
Outputs: y = scale · s / sqrt(mean(s², -1) + epsilon) with s = x + residual (the RMSNorm of trtopt::RMSNorm, on s),
and sum = s, the new residual stream. Attribute: epsilon (float). s is rounded to the inputs' dtype before the
norm reads it, as in the exported Add → RMSNorm it replaces. The normalised row is rounded to scale's dtype before
the scale multiplies it, and y has scale's dtype (the rule pairs only a scale of the inputs' dtype or fp32):
- scale in the inputs' dtype (Llama: ``w · normed.to(x.dtype)``): trtopt::RMSNorm on s;
- fp32 scale, fp16/bf16 inputs (Gemma: ``normed(s.float()) · (1 + w)`` in fp32, then the exported downcast):
  trtopt::RMSNorm on s upcast to fp32, the fp32 math of the original.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape

OP_TYPE = "AddRMSNorm"
INPUTS = ("x", "residual", "scale")
OUTPUTS = ("y", "sum")


def _broadcast(a: Shape, b: Shape) -> Shape:
    a, b = tuple(a), tuple(b)
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    return tuple(y if x == 1 else x if y == 1 or x == y or not isinstance(y, int) else x for x, y in zip(a, b))


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    x, residual, scale = shapes[0], shapes[1], shapes[2]
    s = _broadcast(x, residual) if x is not None and residual is not None else (x or residual)
    if s and scale is not None and len(scale) == 1:
        if isinstance(s[-1], int) and isinstance(scale[0], int) and s[-1] != scale[0]:
            raise BuildError(f"{OP_TYPE}: scale has {scale[0]} entries but the sum's last axis is {s[-1]}; fix the rule.")
    out = tuple(s) if s is not None else ()
    return [out, out]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # TensorRT fuses the body's Add and normalization on its own
    outputs=OUTPUTS,
    attributes=(AttrSpec("epsilon", float, doc="added to the mean square"),),
    infer_shapes=infer_shapes,
)
