"""AllReduce, face 2 of docs/architecture.md §4: the ONNX function body, Identity.

A sum over one rank is the value itself, so a plan sharded for one rank (``trtopt build --tensor-parallel 1``)
runs on onnxruntime, TensorRT and the torch converter's body path exactly like the unsharded plan. For more ranks
the body is wrong by construction (it sees one rank's partial sum); executors that only have the body refuse such
plans (trtopt/runtime/executors/__init__.py, create_executor, says which backends run them).
"""

from __future__ import annotations

import onnx

from trtopt.plugins.all_reduce.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA
from trtopt.plugins.common import BodyBuilder


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    b.op("Identity", "x", name="y")
    return b.function(
        OP_TYPE,
        INPUTS,
        OUTPUTS,
        [a.name for a in SCHEMA.attributes],
        doc="Sum over the tensor-parallel group; Identity for one rank. See trtopt/plugins/all_reduce/schema.py.",
    )
