"""The gate·up product that both gated-MLP rules end in: ``act(g) · u`` (SwiGLU: silu_mul.py; GeGLU: gelu_mul.py).

One contract for both: the activation's value has exactly one reader, a Mul with the up projection u, and g and u are
proven to have one float dtype and one shape (a broadcasting Mul is not a gated MLP). The helpers that prove it
from producers (the paged rewrite clears the exporter's shapes) live here too.
"""

from __future__ import annotations

import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import FLOAT_TYPES, int_list_constant, is_op, projection_weight, same_dims
from trtopt.fusion_passes.ops import DOMAIN, replace_output
from trtopt.fusion_passes.trace import NoMatch


def other_operand(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The binary node's operand that is not ``value`` (None when both are, or neither)."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def sole_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node reading ``value`` when it is a standard ``op_type`` and ``value`` is not a graph output."""
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1 or not is_op(uses[0].node, op_type):
        return None
    return uses[0].node


def gate_up_mul(act: ir.Value, g: ir.Value, what: str) -> tuple[ir.Node, ir.Value]:
    """The ``Mul(act, u)`` that gates the activation ``act = what(g)``, and its u; NoMatch says why not."""
    uses = list(act.uses())
    if act.is_graph_output() or len(uses) != 1:
        raise NoMatch(f"the {what} value has {len(uses)} readers{' and is a graph output' if act.is_graph_output() else ''}"
                      "; it would be computed twice")
    mul = uses[0].node
    if not is_op(mul, "Mul"):
        raise NoMatch(f"the {what} is read by {mul.op_type}, not by a Mul with the up projection", mul.name or "")
    up = other_operand(mul, act)
    if up is None or up is g:
        raise NoMatch(f"the {what} is multiplied by itself or by its own input", mul.name or "")
    if g.dtype is None or g.dtype not in FLOAT_TYPES or up.dtype != g.dtype:
        raise NoMatch(f"gate and up dtypes are {g.dtype} and {up.dtype}, not one float type", mul.name or "")
    if not same_shape(g, up):
        raise NoMatch(f"gate {g.shape} and up {up.shape} are not known to have one shape (a broadcast is not a "
                      "gated MLP)", mul.name or "")
    return mul, up


def same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Proven equal shapes: from the values' shapes where the exporter left them (the paged rewrite clears them),
    else from the producers: two equal parts of one last-axis Split (the horizontal gate/up fusion) or two
    projections of one input by constant weights of one width."""
    if a.shape is not None and b.shape is not None:
        return len(a.shape) == len(b.shape) and all(same_dims(x, y) for x, y in zip(a.shape, b.shape))
    pa, pb = a.producer(), b.producer()
    if pa is None or pb is None:
        return False
    if pa is pb and is_op(pa, "Split"):
        sizes = int_list_constant(pa.inputs[1]) if len(pa.inputs) > 1 else None
        axis = pa.attributes["axis"].value if "axis" in pa.attributes else 0
        return axis == -1 and sizes is not None and sizes[a.index()] == sizes[b.index()]
    na, nb = _projection_width(pa), _projection_width(pb)
    return na is not None and na == nb and pa.inputs[0] is pb.inputs[0]


def _projection_width(node: ir.Node) -> int | None:
    """N of a projection x @ W by a constant [K, N] weight: a MatMul, a trtopt.MatMulAdd, or a trtopt.QMatMul (whose
    quantized weight codes are [K, N] too); else None."""
    w = projection_weight(node)
    if w is None and node.domain == DOMAIN and node.op_type == "QMatMul" and node.inputs[1] is not None:
        w = node.inputs[1].const_value
    return int(w.shape[1]) if w is not None and len(w.shape) == 2 else None


def replace_gated(graph: ir.Graph, mul: ir.Node, op_type: str, rule: str, g: ir.Value, up: ir.Value,
                  dead: list[ir.Node], attrs: tuple[ir.Attr, ...] = ()) -> ir.Node:
    """Put ``trtopt.<op_type>(g, up)`` in place of the gating ``mul``; remove it and the activation's ``dead`` nodes
    (the names get ``.<rule>`` appended).

    No plugin_namespace: the gated ops have no TensorRT plugin, so TensorRT inlines their bodies and fuses the
    pointwise ops itself (plugins/silu_mul/trt_plugin.py says why).
    """
    name = mul.name or mul.outputs[0].name
    fused = ir.Node(DOMAIN, op_type, [g, up], list(attrs), num_outputs=1, name=f"{name}.{rule}")
    graph.insert_before(mul, fused)
    replace_output(mul.outputs[0], fused.outputs[0], rule)
    graph.remove([mul, *dead], safe=True)
    return fused
