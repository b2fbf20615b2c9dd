"""AllReduce, face 1 of docs/architecture.md §4.

Input: x (any float dtype and shape). Output: y, x's shape and dtype: the elementwise sum of x over the
``world_size`` ranks of the tensor-parallel group. Attribute: world_size (int, >= 1), the group size the plan was
sharded for; every runtime that executes the op checks it against its own group (a rank plan run in a group of
another size would silently compute a partial sum).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape

OP_TYPE = "AllReduce"
INPUTS = ("x",)
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    if int(attrs["world_size"]) < 1:
        raise BuildError(f"{OP_TYPE}: world_size must be >= 1, got {attrs['world_size']}; fix the sharding pass.")
    x = shapes[0]
    return [tuple(x) if x is not None else ()]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    # No plugin_namespace on the node: TensorRT inlines the Identity body, which is right for one rank only; the
    # TensorRT executor refuses plans sharded for more (see trt_plugin.py for the multi-rank route).
    tensorrt_plugin=False,
    outputs=OUTPUTS,
    attributes=(AttrSpec("world_size", int, doc="ranks in the tensor-parallel group the plan was sharded for"),),
    infer_shapes=infer_shapes,
)
