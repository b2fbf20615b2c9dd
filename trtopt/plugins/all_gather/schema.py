"""AllGather, face 1 of docs/architecture.md §4.

Input: x (any dtype and shape). Output: y, x's dtype, x's shape with ``axis`` ``world_size`` times as long: the
ranks' x concatenated along ``axis`` in rank order (rank 0's block first). Attributes: world_size (int, >= 1), the
group size the plan was sharded for (every runtime checks it against its own group, as for trtopt.AllReduce); axis
(int, default -1), the axis to concatenate along (the vocabulary axis of the LM head's output).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape

OP_TYPE = "AllGather"
INPUTS = ("x",)
OUTPUTS = ("y",)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    world_size, axis = int(attrs["world_size"]), int(attrs["axis"])
    if world_size < 1:
        raise BuildError(f"{OP_TYPE}: world_size must be >= 1, got {world_size}; fix the sharding pass.")
    x = shapes[0]
    if x is None:
        return [()]
    if not -len(x) <= axis < len(x):
        raise BuildError(f"{OP_TYPE}: axis {axis} is out of range for an input of rank {len(x)}; fix the sharding "
                         "pass.")
    y = list(x)
    d = y[axis]
    y[axis] = d * world_size if isinstance(d, int) else (d if world_size == 1 else None)
    return [tuple(y)]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    # No plugin_namespace on the node: TensorRT inlines the Tile body, which is right for one rank only; the
    # TensorRT executor refuses plans sharded for more (see trt_plugin.py for the multi-rank route).
    tensorrt_plugin=False,
    outputs=OUTPUTS,
    attributes=(
        AttrSpec("world_size", int, doc="ranks in the tensor-parallel group the plan was sharded for"),
        AttrSpec("axis", int, default=-1, doc="the axis the ranks' blocks are concatenated along"),
    ),
    infer_shapes=infer_shapes,
)
