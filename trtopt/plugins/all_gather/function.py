"""AllGather, face 2 of DESIGN.md §4: the ONNX function body, Identity.

The concatenation over one rank is the value itself, so a plan sharded for one rank with a vocabulary-parallel LM
head (``trtopt build --tensor-parallel 1 --lm-head vocab-parallel``) runs on onnxruntime, TensorRT and the torch
converter's body path exactly like the unsharded plan. For more ranks the body is wrong by construction (it sees
one rank's block of the vocabulary); executors that only have the body refuse such plans
(trtopt/runtime/executors/__init__.py, trtopt/runtime/distributed.py).
"""

from __future__ import annotations

import onnx

from trtopt.plugins.all_gather.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA
from trtopt.plugins.common import BodyBuilder


def make_function(opset: int) -> onnx.FunctionProto:
    b = BodyBuilder(opset)
    b.op("Identity", "x", name="y")
    return b.function(
        OP_TYPE,
        INPUTS,
        OUTPUTS,
        [a.name for a in SCHEMA.attributes],
        doc="Concatenation over the tensor-parallel group along `axis`; Identity for one rank. See "
        "trtopt/plugins/all_gather/schema.py.",
    )
