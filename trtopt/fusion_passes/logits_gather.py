"""Rule: project only the rows in ``logits_indices`` to logits (docs/architecture.md §3).

The LM head is the MatMul (or Gemm on a 3-D-free graph) that produces the ``logits`` output. A Gather by
``logits_indices`` on its hidden-state input makes it compute N rows instead of T, and a Squeeze turns
[1, N, vocab] into the [N, vocab] float32 output of the paged signature.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt import signature
from trtopt.errors import FusionError
from trtopt.fusion_passes.ir_helpers import scalar_constant

RULE = "logits_gather"


# Ops between the LM head and `logits` that act on each row alone, so gathering rows before the head is exact:
# Granite's `logits_scaling` (Div by a constant), soft-capping (Div, Tanh, Mul), dtype casts.
_ROW_WISE_UNARY = ("Cast", "Identity", "Tanh")
_ROW_WISE_BINARY = ("Mul", "Div", "Add", "Sub")


def _row_wise_input(node: ir.Node) -> ir.Value | None:
    """The data input of a node that maps each logits row on its own (a unary op, or a binary op with a scalar
    constant), else None."""
    if node.op_type in _ROW_WISE_UNARY:
        return node.inputs[0]
    if node.op_type in _ROW_WISE_BINARY and len(node.inputs) == 2:
        a, b = node.inputs
        if scalar_constant(b) is not None:
            return a
        if node.op_type in ("Mul", "Add") and scalar_constant(a) is not None:
            return b
    return None


def _lm_head(logits: ir.Value) -> tuple[ir.Node, list[ir.Node]]:
    """The MatMul that produces ``logits`` and the row-wise nodes between it and the output."""
    between = []
    node = logits.producer()
    while node is not None and node.op_type != "MatMul" and (data := _row_wise_input(node)) is not None:
        between.append(node)
        node = data.producer()
    if node is None or node.op_type != "MatMul":
        found = node.op_type if node is not None else "a graph input"
        raise FusionError(
            f"the `logits` output is computed by {found}, not by an LM-head MatMul followed by row-wise scaling, so "
            "the build cannot gather the rows in logits_indices. Export the model with a MatMul LM head "
            "(trtopt export writes one)."
        )
    return node, between


def _per_tensor_qdq(hidden: ir.Value) -> tuple[ir.Node, ir.Node] | None:
    """(QuantizeLinear, DequantizeLinear) when the LM head's input is a static per-tensor activation Q/DQ read by
    nothing else (ModelOpt quantizes the LM head that way when its name filter misses it): elementwise, so the rows
    can be gathered before it, where the qmatmul rule still finds the Q/DQ in front of the MatMul."""
    dq = hidden.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or len(hidden.uses()) != 1 or dq.inputs[0] is None:
        return None
    q = dq.inputs[0].producer()
    if q is None or q.op_type != "QuantizeLinear" or len(dq.inputs[0].uses()) != 1 or len(q.inputs) != 3:
        return None
    for node in (q, dq):
        scales = node.inputs[1:3]
        if len(scales) != 2 or any(v is None or v.const_value is None or v.const_value.shape != () for v in scales):
            return None
        if (attr := node.attributes.get("block_size")) is not None and attr.value != 0:
            return None
    return q, dq


def gather_logits(model: ir.Model, *, vocab_size: int | None) -> int:
    """Insert the Gather before the LM head and make ``logits`` [N, vocab] float32; returns 1."""
    graph = model.graph
    outputs = list(graph.outputs)
    logits = next((v for v in outputs if v.name == signature.LOGITS.name), None)
    if logits is None:
        raise FusionError("the graph has no `logits` output; export a causal LM with optimum-style output names.")
    head, between = _lm_head(logits)
    # Values after the Gather hold N rows, not T: drop their stale [batch, seq, ...] shapes.
    for node in (head, *between):
        node.outputs[0].shape = None

    spec = signature.LOGITS_INDICES
    indices = ir.Value(name=spec.name, shape=ir.Shape(list(spec.dims)), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(indices)
    first = head  # the node whose input 0 is gathered: the head, or the per-tensor Q/DQ in front of it
    qdq = _per_tensor_qdq(head.inputs[0])
    if qdq is not None:
        first = qdq[0]
        for node in qdq:
            node.outputs[0].shape = None
    gather = ir.Node("", "Gather", [first.inputs[0], indices], [ir.AttrInt64("axis", 1)], name="logits_gather")
    # hidden: [1, T, H] → [1, N, H]
    first.replace_input_with(0, gather.outputs[0])
    graph.insert_before(first, gather)

    axes = ir.Value(name="logits_squeeze_axes", const_value=ir.tensor(np.array([0], dtype=np.int64)))
    axes.shape, axes.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(axes)
    logits.name = "logits_batched"
    squeeze = ir.Node("", "Squeeze", [logits, axes], name="logits_squeeze")
    tail: list[ir.Node] = [squeeze]
    result = squeeze.outputs[0]
    if logits.dtype != ir.DataType.FLOAT:
        cast = ir.Node("", "Cast", [result], [ir.AttrInt64("to", ir.DataType.FLOAT)], name="logits_cast")
        tail.append(cast)
        result = cast.outputs[0]
    result.name = signature.LOGITS.name
    result.shape = ir.Shape(["N", vocab_size if vocab_size else "vocab"])
    result.type = ir.TensorType(ir.DataType.FLOAT)
    graph.extend(tail)
    graph.outputs[outputs.index(logits)] = result
    return 1
