"""Building trtopt nodes on onnx-ir with the attribute set every trtopt node carries (docs/architecture.md §4)."""

from __future__ import annotations

import onnx_ir as ir

from trtopt.plugins.common import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE


def trtopt_node(
    op_type: str, inputs: list[ir.Value | None], attrs: list[ir.Attr], *, num_outputs: int, name: str
) -> ir.Node:
    """A node in the trtopt domain; ``plugin_namespace`` lets the TensorRT parser pick the plugin over the body."""
    attrs = [*attrs, ir.AttrString("plugin_namespace", PLUGIN_NAMESPACE)]
    # Trailing absent optional inputs are dropped rather than written as "".
    while inputs and inputs[-1] is None:
        inputs = inputs[:-1]
    return ir.Node(DOMAIN, op_type, inputs, attrs, num_outputs=num_outputs, name=name)


def declare_domain(model: ir.Model) -> None:
    model.opset_imports[DOMAIN] = OPSET_VERSION


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Point every reader of ``old`` at ``new``; a graph output keeps its public name."""
    was_output = old.is_graph_output()
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if was_output:
        name = old.name
        old.name = f"{name}.replaced"
        new.name = name


def replace_output(old: ir.Value, new: ir.Value, suffix: str) -> None:
    """A fused node's output ``new`` takes ``old``'s place: named ``{old.name}.{suffix}``, with old's type and shape,
    and every reader of old (see replace_value)."""
    new.name = f"{old.name}.{suffix}"
    new.type, new.shape = old.type, old.shape
    replace_value(old, new)


def cast_like_original(graph: ir.Graph, fused: ir.Value, original: ir.Value, after: ir.Node) -> ir.Value:
    """``fused`` (the op's output, in q's dtype) as a drop-in for ``original``: a Cast is added after ``after``
    when the exporter had computed attention in another dtype (fp16 models upcast to fp32 around Softmax)."""
    fused.type = ir.TensorType(fused.dtype) if fused.dtype is not None else original.type
    if original.dtype is None or fused.dtype is None or original.dtype == fused.dtype:
        return fused
    cast = ir.Node("", "Cast", [fused], [ir.AttrInt64("to", original.dtype)], name=f"{after.name}.cast")
    graph.insert_after(after, cast)
    cast.outputs[0].type = original.type
    return cast.outputs[0]
