"""trtopt ops: one folder per op, each with the five faces of docs/architecture.md §4.

The two registries below are how the rest of trtopt finds an op. To add an op, create its folder with
``schema.py`` (a ``SCHEMA``) and ``function.py`` (``make_function(opset)``) and add one line to each registry.
Only ONNX-level modules are imported here, so importing the registry never pulls in torch or Triton.
"""

from __future__ import annotations

from typing import Callable

import onnx

from trtopt.plugins import common
from trtopt.plugins.add_rms_norm import function as add_rms_norm_function
from trtopt.plugins.add_rms_norm import schema as add_rms_norm_schema
from trtopt.plugins.common import DOMAIN, OPSET_VERSION, OpSchema, attach_functions, make_node
from trtopt.plugins.all_reduce import function as all_reduce_function
from trtopt.plugins.all_reduce import schema as all_reduce_schema
from trtopt.plugins.all_gather import function as all_gather_function
from trtopt.plugins.all_gather import schema as all_gather_schema
from trtopt.plugins.flash_attention import function as flash_attention_function
from trtopt.plugins.flash_attention import schema as flash_attention_schema
from trtopt.plugins.gelu_mul import function as gelu_mul_function
from trtopt.plugins.gelu_mul import schema as gelu_mul_schema
from trtopt.plugins.matmul_add import function as matmul_add_function
from trtopt.plugins.matmul_add import schema as matmul_add_schema
from trtopt.plugins.paged_attention import function as paged_attention_function
from trtopt.plugins.paged_attention import schema as paged_attention_schema
from trtopt.plugins.qmatmul import function as qmatmul_function
from trtopt.plugins.qmatmul import schema as qmatmul_schema
from trtopt.plugins.rms_norm import function as rms_norm_function
from trtopt.plugins.rms_norm import schema as rms_norm_schema
from trtopt.plugins.rope import function as rope_function
from trtopt.plugins.rope import schema as rope_schema
from trtopt.plugins.silu_mul import function as silu_mul_function
from trtopt.plugins.silu_mul import schema as silu_mul_schema

# op_type → its schema (attributes, optional inputs, shape inference).
OP_SCHEMAS: dict[str, OpSchema] = {
    paged_attention_schema.OP_TYPE: paged_attention_schema.SCHEMA,
    flash_attention_schema.OP_TYPE: flash_attention_schema.SCHEMA,
    rms_norm_schema.OP_TYPE: rms_norm_schema.SCHEMA,  # added by the fusion engineer
    matmul_add_schema.OP_TYPE: matmul_add_schema.SCHEMA,  # added by the fusion engineer
    all_reduce_schema.OP_TYPE: all_reduce_schema.SCHEMA,  # inserted by the tensor-parallel sharding pass
    all_gather_schema.OP_TYPE: all_gather_schema.SCHEMA,  # after a vocabulary-parallel LM head (the same pass)
    silu_mul_schema.OP_TYPE: silu_mul_schema.SCHEMA,  # SwiGLU (fusion_passes/silu_mul.py)
    add_rms_norm_schema.OP_TYPE: add_rms_norm_schema.SCHEMA,  # residual add + RMSNorm (fusion_passes/add_rms_norm.py)
    rope_schema.OP_TYPE: rope_schema.SCHEMA,  # rotary embedding (fusion_passes/rope.py)
    gelu_mul_schema.OP_TYPE: gelu_mul_schema.SCHEMA,  # GeGLU (fusion_passes/gelu_mul.py)
    qmatmul_schema.OP_TYPE: qmatmul_schema.SCHEMA,  # Q/DQ weight (+ activation) → MatMul (fusion_passes/qmatmul.py)
}

# op_type → make_function(opset): the op's ONNX function body for a model of that standard opset.
FUNCTION_BUILDERS: dict[str, Callable[[int], onnx.FunctionProto]] = {
    paged_attention_schema.OP_TYPE: paged_attention_function.make_function,
    flash_attention_schema.OP_TYPE: flash_attention_function.make_function,
    rms_norm_schema.OP_TYPE: rms_norm_function.make_function,  # added by the fusion engineer
    matmul_add_schema.OP_TYPE: matmul_add_function.make_function,  # added by the fusion engineer
    all_reduce_schema.OP_TYPE: all_reduce_function.make_function,  # inserted by the tensor-parallel sharding pass
    all_gather_schema.OP_TYPE: all_gather_function.make_function,  # after a vocabulary-parallel LM head (the same pass)
    silu_mul_schema.OP_TYPE: silu_mul_function.make_function,  # SwiGLU (fusion_passes/silu_mul.py)
    add_rms_norm_schema.OP_TYPE: add_rms_norm_function.make_function,  # fusion_passes/add_rms_norm.py
    rope_schema.OP_TYPE: rope_function.make_function,  # fusion_passes/rope.py
    gelu_mul_schema.OP_TYPE: gelu_mul_function.make_function,  # GeGLU (fusion_passes/gelu_mul.py)
    qmatmul_schema.OP_TYPE: qmatmul_function.make_function,  # fusion_passes/qmatmul.py
}

__all__ = ["DOMAIN", "OPSET_VERSION", "OP_SCHEMAS", "FUNCTION_BUILDERS", "OpSchema", "attach_functions", "make_node",
           "common"]
