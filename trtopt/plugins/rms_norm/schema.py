"""RMSNorm, face 1 of docs/architecture.md §4.

Inputs: x [..., H] (float type), scale [H]. Output: y, x's shape and dtype. Attribute: epsilon (float).
The normalisation is computed in fp32 and cast back to x's dtype, like HF's LlamaRMSNorm.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape

OP_TYPE = "RMSNorm"
INPUTS = ("x", "scale")
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    x, scale = shapes[0], shapes[1]
    if x is not None and scale is not None and len(scale) == 1:
        if isinstance(x[-1], int) and isinstance(scale[0], int) and x[-1] != scale[0]:
            raise BuildError(f"{OP_TYPE}: scale has {scale[0]} entries but x's last axis is {x[-1]}; fix the rule.")
    return [tuple(x) if x is not None else ()]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # no Triton kernel: TensorRT inlines the function body (standard ops)
    outputs=OUTPUTS,
    attributes=(AttrSpec("epsilon", float, doc="added to the mean square"),),
    infer_shapes=infer_shapes,
)
