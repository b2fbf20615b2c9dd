"""MatMulAdd, face 1 of docs/architecture.md §4.

Inputs: x [..., K], weight [K, N], bias [N] (one float dtype). Output: y [..., N]. No attributes besides the
TensorRT ones every trtopt node carries.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import OpSchema, Shape

OP_TYPE = "MatMulAdd"
INPUTS = ("x", "weight", "bias")
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    x, weight, bias = (tuple(s) if s is not None else None for s in shapes[:3])
    if weight is None or len(weight) != 2:
        raise BuildError(f"{OP_TYPE}: weight must be [K, N], got {weight}; fix the rule that made the node.")
    if bias is not None and isinstance(bias[0], int) and isinstance(weight[1], int) and bias[0] != weight[1]:
        raise BuildError(f"{OP_TYPE}: bias {bias} does not match weight {weight}; fix the rule that made the node.")
    if x is None:
        return [()]
    if isinstance(x[-1], int) and isinstance(weight[0], int) and x[-1] != weight[0]:
        raise BuildError(f"{OP_TYPE}: x {x} cannot be multiplied by weight {weight}.")
    return [(*x[:-1], weight[1])]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # no Triton kernel: TensorRT inlines the function body (standard ops)
    outputs=OUTPUTS,
    attributes=(),
    infer_shapes=infer_shapes,
)
