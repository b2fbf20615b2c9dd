"""Rope, face 1 of docs/architecture.md §4.

Inputs: x [..., D] (the rank-4 [B, H, T, D] of the exported graphs), cos and sin broadcastable to x (HF: [1, 1, T, D]),
one float dtype. Output: y = x · cos + concat(−x[..., half:], x[..., :half]) · sin, the broadcast shape of the
inputs. Attribute: half (int): where the rotation splits the last axis; 0 means D // 2 read at run time
(TorchScript exports compute it from x's shape). Each product is rounded to the dtype before the sum, as in the
exported Mul → Mul → Add.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape

OP_TYPE = "Rope"
INPUTS = ("x", "cos", "sin")
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    x = shapes[0]
    half = attrs.get("half", 0)
    if half < 0:
        raise BuildError(f"{OP_TYPE}: half must be >= 0 (0: D // 2), got {half}; fix the rule.")
    if x is not None and x and isinstance(x[-1], int) and half > x[-1]:
        raise BuildError(f"{OP_TYPE}: half {half} exceeds x's last axis {x[-1]}; fix the rule.")
    return [tuple(x) if x is not None else ()]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # TensorRT fuses the body's slices, Neg, Concat, Muls and Add on its own
    outputs=OUTPUTS,
    attributes=(AttrSpec("half", int, default=0, doc="split point of the last axis; 0 = D // 2 at run time"),),
    infer_shapes=infer_shapes,
)
