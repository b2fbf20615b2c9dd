"""Rule: SwiGLU's SiLU·mul → trtopt.SiluMul (ONNX has no SiLU op up to opset 23; its body is the same three ops).

    y = (g · Sigmoid(g)) · u     (either operand order of both Muls)   →   y = SiluMul(g, u)

as both exporters write HF's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = SiLU``. Three pointwise kernels
per layer that each read and write the [T, intermediate] tensor become one (a Triton kernel in the torch executor
on CUDA; on CPU the same arithmetic with one allocation instead of three; TensorRT inlines the body and fuses it).

Matched only when the SiLU value has no other reader (else it would be computed twice) and g and u are known to
have one dtype and one shape (a broadcasting Mul is not SwiGLU). A SiLU left alone is recorded in the trace with
the reason, for ``trtopt build --explain``.
"""

from __future__ import annotations

import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import FLOAT_TYPES, int_list_constant, is_op, same_dims
from trtopt.fusion_passes.ops import DOMAIN, declare_domain, replace_output
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "silu_mul"


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The Mul's operand that is not ``value`` (None when both are)."""
    a, b = node.inputs
    return b if a is value else a if b is value else None


def _silu(sigmoid: ir.Node) -> ir.Node | None:
    """The ``Mul(g, Sigmoid(g))`` that reads this Sigmoid, or None when the Sigmoid is not a SiLU."""
    g = sigmoid.inputs[0]
    uses = list(sigmoid.outputs[0].uses())
    if len(uses) != 1 or not is_op(uses[0].node, "Mul") or _other(uses[0].node, sigmoid.outputs[0]) is not g:
        return None
    return uses[0].node


def _gate_mul(silu: ir.Node, g: ir.Value) -> tuple[ir.Node, ir.Value]:
    """The ``Mul(silu, u)`` and its u; NoMatch says why this SiLU is not a SwiGLU."""
    out = silu.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1:
        raise NoMatch(f"the SiLU value has {len(uses)} readers{' and is a graph output' if out.is_graph_output() else ''}"
                      "; it would be computed twice")
    mul = uses[0].node
    if not is_op(mul, "Mul"):
        raise NoMatch(f"the SiLU is read by {mul.op_type}, not by a Mul with the up projection", mul.name or "")
    up = _other(mul, out)
    if up is None or up is g:
        raise NoMatch("the SiLU is multiplied by itself or by its own input", mul.name or "")
    if g.dtype is None or g.dtype not in FLOAT_TYPES or up.dtype != g.dtype:
        raise NoMatch(f"gate and up dtypes are {g.dtype} and {up.dtype}, not one float type", mul.name or "")
    if not _same_shape(g, up):
        raise NoMatch(f"gate {g.shape} and up {up.shape} are not known to have one shape (a broadcast is not "
                      "SwiGLU)", mul.name or "")
    return mul, up


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
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
    wa, wb = _projection_width(pa), _projection_width(pb)
    return wa is not None and wa == wb and pa.inputs[0] is pb.inputs[0]


def _projection_width(node: ir.Node) -> int | None:
    """N of ``x @ W`` (MatMul or trtopt.MatMulAdd) with a constant [K, N] weight, else None."""
    if not (is_op(node, "MatMul") or (node.domain == DOMAIN and node.op_type == "MatMulAdd")):
        return None
    w = node.inputs[1].const_value if node.inputs[1] is not None else None
    return int(w.shape[1]) if w is not None and len(w.shape) == 2 else None


def fuse_silu_mul(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every SwiGLU SiLU·mul into trtopt.SiluMul; returns the count (one per layer on Llama-family models)."""
    graph = model.graph
    count = 0
    for sigmoid in [n for n in graph if is_op(n, "Sigmoid")]:
        silu = _silu(sigmoid)
        if silu is None:
            continue
        g = sigmoid.inputs[0]
        try:
            mul, up = _gate_mul(silu, g)
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, silu.name or "", e)
            continue
        name = mul.name or mul.outputs[0].name
        # No plugin_namespace: SiluMul has no TensorRT plugin, so TensorRT must inline its body (trt_plugin.py).
        fused = ir.Node(DOMAIN, "SiluMul", [g, up], num_outputs=1, name=f"{name}.silu_mul")
        graph.insert_before(mul, fused)
        replace_output(mul.outputs[0], fused.outputs[0], "silu_mul")
        graph.remove([mul, silu, sigmoid], safe=True)
        count += 1
    if count:
        declare_domain(model)
    return count
