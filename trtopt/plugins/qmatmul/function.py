"""QMatMul, face 2 of docs/architecture.md §4: the body is the Q/DQ graph it replaces, op for op.

    w = DequantizeLinear(w_q, w_scale, w_zero_point, axis=@axis, block_size=@block_size)
    act_mode 0: y = MatMul(x, w)
    act_mode 1: y = MatMul(DequantizeLinear(QuantizeLinear(x, act_scale, act_zero_point), ...), w)
    act_mode 2: y = MatMul(DequantizeLinear(QuantizeLinear(x, act_scale, axis=-1, block_size=@act_block_size,
                                                            output_dtype=FLOAT8E4M3FN), ...), w)

One FunctionProto serves every node of the op, so the activation form is chosen by If on the inputs act_quantized
and act_static: bool initializers that the rule derives from ``act_mode``. ORT runs only the taken branch, and
TensorRT's parser imports only the taken branch of an If whose condition is weights (an initializer or a Constant;
an Equal on the act_mode attribute would be a tensor, and TensorRT would build an IIfConditional with Q/DQ inside
both branches). The branches read the body's values from the outer scope. A zero point of zeros is the same
DequantizeLinear as none, so an absent weight zero point is written as zeros by the rule.

Needs opset >= 19 (FP8); below 21 (no blocked Q/DQ, no int4) the body has no block_size and no dynamic branch: the
rule makes only per-channel FP8 nodes with act_mode 0 or 1 there.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from trtopt.plugins.common import BodyBuilder
from trtopt.plugins.qmatmul.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA

MIN_OPSET = 19
BLOCKED_OPSET = 21  # DequantizeLinear/QuantizeLinear block_size, int4/uint4


def _with_refs(node: onnx.NodeProto, **refs: str) -> onnx.NodeProto:
    """``node`` with INT attributes that take the calling node's attribute of the given name."""
    for name, ref in refs.items():
        node.attribute.append(helper.make_attribute_ref(name, onnx.AttributeProto.INT, ref_attr_name=ref))
    return node


def _branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [onnx.ValueInfoProto(name=out)])


def make_function(opset: int) -> onnx.FunctionProto:
    # Below MIN_OPSET the body is still built (the registry builds every op for any model opset) but never used:
    # no QMatMul node can exist there, the rule fuses only at MIN_OPSET and above (FP8 Q/DQ needs opset 19).
    b = BodyBuilder(opset)
    blocked = opset >= BLOCKED_OPSET
    refs = {"axis": "axis", **({"block_size": "block_size"} if blocked else {})}
    b.nodes.append(_with_refs(helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero_point"], ["w"]), **refs))
    plain = _branch("qmatmul_plain", [helper.make_node("MatMul", ["x", "w"], ["y_plain"])], "y_plain")
    static = _branch("qmatmul_static", [
        helper.make_node("QuantizeLinear", ["x", "act_scale", "act_zero_point"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "act_scale", "act_zero_point"], ["x_dq"]),
        helper.make_node("MatMul", ["x_dq", "w"], ["y_static"]),
    ], "y_static")
    dynamic = _branch("qmatmul_dynamic", [
        _with_refs(helper.make_node("QuantizeLinear", ["x", "act_scale"], ["x_qd"], axis=-1,
                                    output_dtype=TensorProto.FLOAT8E4M3FN), block_size="act_block_size"),
        _with_refs(helper.make_node("DequantizeLinear", ["x_qd", "act_scale"], ["x_dqd"], axis=-1),
                   block_size="act_block_size"),
        helper.make_node("MatMul", ["x_dqd", "w"], ["y_dynamic"]),
    ], "y_dynamic")
    # The static/dynamic If sits inside the quantized branch, so that it runs only when the activation is quantized.
    quantized = _branch("qmatmul_quantized", [helper.make_node("If", ["act_static"], ["y_quantized"],
                                                               then_branch=static, else_branch=dynamic)],
                        "y_quantized") if blocked else static
    b.op("If", "act_quantized", then_branch=quantized, else_branch=plain, name="y")
    attrs = [a.name for a in SCHEMA.attributes]
    return b.function(OP_TYPE, INPUTS, OUTPUTS, attrs, doc="Q/DQ MatMul; see trtopt/plugins/qmatmul/schema.py.")
