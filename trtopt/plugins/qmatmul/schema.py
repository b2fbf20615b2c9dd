"""QMatMul, face 1 of docs/architecture.md §4.

Inputs (all present: the fusion rule writes typed zeros / ones where the producer had none, because the function
body's If branches are type-checked even when not taken, so the shared float32 zero filler cannot stand in):

    x               [..., K]  float (the activation before any activation quantization)
    w_q             [K, N]    float8e4m3fn, int4 or uint4 (constant)
    w_scale         [N] (FP8, axis=1) or [K/G, N] (INT4/UINT4, axis=0, block_size=G), x's float dtype
    w_zero_point    like w_scale, w_q's dtype (zeros when the producer had none)
    act_scale       act_mode static: [] (per tensor); dynamic: [..., 1] (per token, computed in the graph);
                    none: a [] placeholder (1.0)
    act_zero_point  [] float8e4m3fn zero
    act_quantized   [] bool: act_mode != ACT_NONE  } what the body's Ifs branch on: initializers, so that TensorRT
    act_static      [] bool: act_mode == ACT_STATIC } imports only the taken branch (see function.py)

Attributes: axis, block_size (0 = per output channel) of the weight's DequantizeLinear; act_mode (ACT_NONE,
ACT_STATIC, ACT_DYNAMIC); act_block_size (K for ACT_DYNAMIC: the blocked per-token Q/DQ's block_size, else 0);
weight_dtype (w_q's ONNX dtype: FLOAT8E4M3FN, INT4 or UINT4, for kernels and for reading a plan; an INT
because trtopt.plugins.common reads STRING attributes back as bytes).
Output: y [..., N] in x's dtype.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from onnx import TensorProto

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape, expect_dim

OP_TYPE = "QMatMul"
INPUTS = ("x", "w_q", "w_scale", "w_zero_point", "act_scale", "act_zero_point", "act_quantized", "act_static")
OUTPUTS = ("y",)
ACT_NONE, ACT_STATIC, ACT_DYNAMIC = 0, 1, 2
WEIGHT_DTYPES = (TensorProto.FLOAT8E4M3FN, TensorProto.INT4, TensorProto.UINT4)


def infer_shapes(shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    x, w, scale = (tuple(s) if s is not None else None for s in shapes[:3])
    if w is None or len(w) != 2:
        raise BuildError(f"{OP_TYPE}: w_q must be [K, N], got {w}; fix the rule that made the node.")
    if attrs["weight_dtype"] not in WEIGHT_DTYPES:
        raise BuildError(f"{OP_TYPE}: weight_dtype {attrs['weight_dtype']!r} is not one of {WEIGHT_DTYPES}.")
    if attrs["act_mode"] not in (ACT_NONE, ACT_STATIC, ACT_DYNAMIC):
        raise BuildError(f"{OP_TYPE}: act_mode {attrs['act_mode']} is not 0 (none), 1 (static) or 2 (dynamic).")
    block = attrs["block_size"]
    if scale is not None:
        k, n = w
        expected = (n,) if block == 0 else ((k // block if isinstance(k, int) else None), n)
        if len(scale) != len(expected):
            raise BuildError(f"{OP_TYPE}: w_scale {scale} does not fit w_q {w} with block_size {block}.")
        for i, (a, e) in enumerate(zip(scale, expected)):
            expect_dim(OP_TYPE, f"w_scale dim {i}", a, e)
    for name, flag in zip(INPUTS[6:], shapes[6:8]):
        if flag is not None and tuple(flag) != ():
            raise BuildError(f"{OP_TYPE}: {name} must be a bool scalar [], got {tuple(flag)}; fix the rule.")
    if x is None:
        return [()]
    expect_dim(OP_TYPE, "x's last dim (K)", x[-1], w[0])
    return [(*x[:-1], w[1])]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={},
    tensorrt_plugin=False,  # TensorRT inlines the body: plain Q/DQ → MatMul, which it fuses itself
    outputs=OUTPUTS,
    attributes=(
        AttrSpec("axis", int, doc="the weight DequantizeLinear's axis: 1 (per output channel) or 0 (blocked)"),
        AttrSpec("block_size", int, 0, doc="the weight DequantizeLinear's block_size along K; 0 = per channel"),
        AttrSpec("act_mode", int, ACT_NONE, doc="0: x as is, 1: static per-tensor FP8 Q/DQ, 2: dynamic per-token"),
        AttrSpec("act_block_size", int, 0, doc="K for act_mode 2 (blocked per-token Q/DQ), else 0"),
        AttrSpec("weight_dtype", int, doc="w_q's ONNX dtype: FLOAT8E4M3FN (17), INT4 (22) or UINT4 (21)"),
    ),
    infer_shapes=infer_shapes,
)
