"""AllGather, face 2 of docs/architecture.md §4: the ONNX function body, ``Tile`` of x ``world_size`` times along
``axis``.

For one rank that is the identity, so a plan sharded for one rank with a vocabulary-parallel LM head
(``trtopt build --tensor-parallel 1 --lm-head vocab-parallel``) runs on onnxruntime, TensorRT and the torch
converter's body path exactly like the unsharded plan. For more ranks the body has the op's output *shape* (so ONNX
shape inference through the function agrees with the plan's declared ``logits`` width; a plain Identity made the
checker reject every N > 1 rank plan) but not its values: it repeats this rank's block of the vocabulary instead of
fetching the others'. Executors that only have the body refuse such plans (trtopt/runtime/executors/__init__.py,
create_executor), as for trtopt.AllReduce.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from trtopt.plugins.all_gather.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA
from trtopt.plugins.common import BodyBuilder


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    rank = b.op("Shape", b.op("Shape", "x"))  # [1]: x's rank
    ones = b.op("ConstantOfShape", rank, value=helper.make_tensor("value", TensorProto.INT64, [1], [1]))
    axis = b.op("Unsqueeze", b.attr("axis", int), b.ints(0))  # [1]; negative axes index from the back
    world = b.op("Unsqueeze", b.attr("world_size", int), b.ints(0))
    repeats = b.op("ScatterElements", ones, axis, world, axis=0)  # 1 everywhere, world_size at `axis`
    b.op("Tile", "x", repeats, name="y")
    return b.function(
        OP_TYPE,
        INPUTS,
        OUTPUTS,
        [a.name for a in SCHEMA.attributes],
        doc="Concatenation over the tensor-parallel group along `axis`; the identity for one rank (the body tiles "
        "this rank's block: right shape, and right values for one rank only). See trtopt/plugins/all_gather/schema.py.",
    )
