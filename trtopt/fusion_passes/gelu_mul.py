"""Rule: GeGLU's GELU·mul → trtopt.GeluMul (ONNX has Gelu from opset 20, but no gated form at any opset).

    y = gelu(g) · u     →   y = GeluMul(g, u, tanh=1 | 0)

as the exporters write HF's ``act_fn(gate_proj(x)) * up_proj(x)`` with a GELU ``act_fn`` (Gemma / Gemma-3:
``gelu_pytorch_tanh``). The GELU value is recognised in each form they write:

- the ONNX ``Gelu`` op (the legacy exporter at opset ≥ 20), ``approximate`` "tanh" or "none";
- the tanh form 0.5·g·(1 + Tanh(√(2/π)·(g + 0.044715·g³))), with g³ as ``Pow(g, 3)`` (dynamo, any opset) or
  ``Mul(g, Mul(g, g))`` (legacy below 20);
- the exact form 0.5·g·(1 + Erf(g / √2)) (``Div`` by √2 or ``Mul`` by 1/√2);

with either operand order of every Add and Mul, and the outer product 0.5·g·(1 + t) in any association (dynamo:
g·(0.5·(1 + t)); legacy: (g·(1 + t))·0.5). The constants are compared with a relative tolerance of 4e-3, which
admits their fp16/bf16 roundings and nothing else. Every intermediate value must have one reader.

About a dozen pointwise kernels per layer, each reading and writing the [T, intermediate] tensor, become one (a
Triton kernel in the torch executor on CUDA; on CPU the same arithmetic in one buffer; TensorRT inlines the body
and fuses it). A GELU that no Mul gates (GPT-2's MLP: it feeds a MatMul, and a Shape in TorchScript exports) is not
a GeGLU and is left silently; a gated one that is also read elsewhere, or gated by an up value of another shape or
dtype, is recorded in the trace with the reason, for ``trtopt build --explain``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from trtopt.fusion_passes.gated_mul import gate_up_mul, other_operand, replace_gated, sole_reader
from trtopt.fusion_passes.ir_helpers import is_constant, is_op, scalar_constant
from trtopt.fusion_passes.ops import declare_domain
from trtopt.fusion_passes.trace import NoMatch, Trace
from trtopt.plugins.gelu_mul.schema import KAPPA, SQRT_2, SQRT_2_OVER_PI

RULE = "gelu_mul"
# A bf16 constant is within 2⁻⁹ of its value: the tolerance admits every float rounding of the GELU constants.
_RTOL = 4e-3


@dataclasses.dataclass(frozen=True)
class _Gelu:
    """A GELU found in the graph: its input g, its value, whether it is the tanh form, and the nodes computing it."""

    g: ir.Value
    value: ir.Value
    tanh: bool
    nodes: tuple[ir.Node, ...]


def _is_const(value: ir.Value | None, expected: float) -> bool:
    c = scalar_constant(value)
    return c is not None and abs(c - expected) <= _RTOL * abs(expected)


def _const_operand(node: ir.Node, expected: float) -> ir.Value | None:
    """The other operand of a binary node one of whose operands is the constant ``expected``, else None."""
    a, b = node.inputs[0], node.inputs[1]
    return b if _is_const(a, expected) else a if _is_const(b, expected) else None


def _producer(value: ir.Value, op_type: str) -> ir.Node | None:
    """The standard ``op_type`` node producing ``value`` when ``value`` has no other reader, else None."""
    node = value.producer()
    if not is_op(node, op_type) or len(list(value.uses())) != 1 or value.is_graph_output():
        return None
    return node


def _cube_of(value: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when ``value`` is x³ written as ``Pow(x, 3)`` or ``x·(x·x)`` (either order), else None."""
    pow_node = _producer(value, "Pow")
    if pow_node is not None:
        return (pow_node.inputs[0], [pow_node]) if scalar_constant(pow_node.inputs[1]) == 3.0 else None
    outer = _producer(value, "Mul")
    if outer is None:
        return None
    for x, square in (outer.inputs, reversed(outer.inputs)):
        inner = _producer(square, "Mul")
        if inner is not None and inner.inputs[0] is x and inner.inputs[1] is x:
            return x, [outer, inner]
    return None


def _tanh_argument(tanh: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(g, nodes) when the Tanh reads √(2/π)·(g + 0.044715·g³), else None."""
    scaled = _producer(tanh.inputs[0], "Mul")
    inner = _const_operand(scaled, SQRT_2_OVER_PI) if scaled is not None else None
    add = _producer(inner, "Add") if inner is not None else None
    if add is None:
        return None
    for g, term in (add.inputs, reversed(add.inputs)):
        mul = _producer(term, "Mul")
        cube = _const_operand(mul, KAPPA) if mul is not None else None
        found = _cube_of(cube) if cube is not None else None
        if found is not None and found[0] is g:
            return g, [scaled, add, mul, *found[1]]
    return None


def _erf_argument(erf: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(g, nodes) when the Erf reads g / √2 (or g · 1/√2), else None."""
    div = _producer(erf.inputs[0], "Div")
    if div is not None:
        return (div.inputs[0], [div]) if _is_const(div.inputs[1], SQRT_2) else None
    mul = _producer(erf.inputs[0], "Mul")
    g = _const_operand(mul, 1.0 / SQRT_2) if mul is not None else None
    return (g, [mul]) if g is not None else None


def _half_g_times(t: ir.Value, g: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(value, nodes) of 0.5·g·(1 + t) in any association and operand order, starting from t; else None."""
    add = sole_reader(t, "Add")
    if add is None or not _is_const(other_operand(add, t), 1.0):
        return None
    nodes, value = [add], add.outputs[0]
    need_g, need_half = True, True
    while need_g or need_half:
        mul = sole_reader(value, "Mul")
        factor = other_operand(mul, value) if mul is not None else None
        if factor is None:
            return None
        half_g = _producer(factor, "Mul")
        if need_g and factor is g:
            need_g = False
        elif need_half and _is_const(factor, 0.5):
            need_half = False
        elif need_g and need_half and half_g is not None and _const_operand(half_g, 0.5) is g:
            need_g = need_half = False
            nodes.append(half_g)
        else:
            return None
        nodes.append(mul)
        value = mul.outputs[0]
    return value, nodes


def _gelu(node: ir.Node) -> _Gelu | None:
    """The GELU that this Gelu, Tanh or Erf node is the core of, or None when it is not one."""
    if is_op(node, "Gelu"):
        approximate = node.attributes["approximate"].value if "approximate" in node.attributes else "none"
        return _Gelu(node.inputs[0], node.outputs[0], approximate == "tanh", (node,))
    tanh = is_op(node, "Tanh")
    found = _tanh_argument(node) if tanh else _erf_argument(node) if is_op(node, "Erf") else None
    if found is None:
        return None
    g, inner = found
    outer = _half_g_times(node.outputs[0], g)
    if outer is None:
        return None
    value, outer_nodes = outer
    return _Gelu(g, value, tanh, (*inner, node, *outer_nodes))


def _plain(value: ir.Value) -> bool:
    """No reader multiplies the GELU by a computed value: an ungated MLP (GPT-2, GPT-NeoX, Falcon), nothing to fuse
    and nothing to explain (reporting it would flag every classic GELU model in ``--explain``)."""
    return not any(is_op(use.node, "Mul") and not is_constant(other_operand(use.node, value)) for use in value.uses())


def fuse_gelu_mul(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every GeGLU GELU·mul into trtopt.GeluMul; returns the count (one per layer on Gemma / Gemma-3)."""
    graph = model.graph
    count = 0
    for node in [n for n in graph if is_op(n, "Gelu") or is_op(n, "Tanh") or is_op(n, "Erf")]:
        gelu = _gelu(node)
        if gelu is None or _plain(gelu.value):
            continue
        try:
            mul, up = gate_up_mul(gelu.value, gelu.g, "GELU")
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, node.name or "", e)
            continue
        replace_gated(graph, mul, "GeluMul", RULE, gelu.g, up, dead=list(gelu.nodes),
                      attrs=(ir.AttrInt64("tanh", int(gelu.tanh)),))
        count += 1
    if count:
        declare_domain(model)
    return count
