"""Rule: MatMuls that read one input with constant weights → one MatMul over the concatenated weights + Split.

    q = x @ Wq (+ bq);  k = x @ Wk (+ bk);  v = x @ Wv (+ bv)
        →  [q | k | v] = Split(x @ [Wq | Wk | Wv] (+ [bq | bk | bv]), axis=-1)

This is TensorRT's horizontal fusion, done in the plan so every executor reads it: Q, K and V become one GEMM per
layer, gate and up another. At batch-1 decode each projection is a GEMV whose launch and latency, not its bytes,
set its time (the 2 MB K/V projections of a 1B Llama ran at ~1 TB/s on an H200), so 5 GEMVs per layer become 2.
The Split outputs are views for the torch executor (no copy). Biases (Qwen2) are concatenated too when every
member of the group has one; then the biased MatMul is left to the matmul_add rule, which runs after this one.

Only standard ops are produced (MatMul, Add, Split with split sizes as an input: opset ≥ 13), so no new op faces.
A group is every MatMul that reads the same input value with a constant 2-D weight of one dtype and one K.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import is_op
from trtopt.fusion_passes.ops import replace_value
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "horizontal_matmul"


def _weight(node: ir.Node) -> ir.Value | None:
    """The constant [K, N] weight of `x @ W`, or None."""
    if not is_op(node, "MatMul") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    return w


def _bias_add(node: ir.Node, width: int) -> tuple[ir.Node, ir.Value] | None:
    """The Add of a constant [N] bias that is the MatMul's only reader, or None."""
    out = node.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output():
        return None
    add = uses[0].node
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    bias = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    c = bias.const_value if bias is not None else None
    if c is None or tuple(c.shape) != (width,) or c.dtype != node.inputs[1].const_value.dtype:
        return None
    return add, bias


def _groups(graph: ir.Graph, trace: Trace | None) -> list[list[ir.Node]]:
    by_input: dict[ir.Value, list[ir.Node]] = {}
    for node in graph:
        if _weight(node) is not None and node.inputs[0] is not None:
            by_input.setdefault(node.inputs[0], []).append(node)
    groups = []
    for nodes in by_input.values():
        if len(nodes) < 2:
            continue
        kinds = {(n.inputs[1].const_value.dtype, n.inputs[1].const_value.shape[0]) for n in nodes}
        if len(kinds) != 1:
            if trace is not None:
                trace.fail(RULE, nodes[0].name or "", NoMatch(f"weights differ in dtype or K: {sorted(map(str, kinds))}"))
            continue
        groups.append(nodes)
    return groups


def _concat(values: list[ir.Value], axis: int) -> np.ndarray:
    return np.concatenate([v.const_value.numpy() for v in values], axis=axis)


def _fuse(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    first = nodes[0]
    name = first.name or first.outputs[0].name
    x = first.inputs[0]
    weights = [n.inputs[1] for n in nodes]
    widths = [w.const_value.shape[1] for w in weights]
    biases = [_bias_add(n, width) for n, width in zip(nodes, widths)]
    with_bias = all(b is not None for b in biases)

    w_cat = ir.Value(name=f"{name}.hfused.weight", const_value=ir.tensor(_concat(weights, 1), name=f"{name}.hfused.weight"))
    w_cat.type, w_cat.shape = ir.TensorType(weights[0].dtype), ir.Shape(w_cat.const_value.shape)
    graph.register_initializer(w_cat)
    sizes = ir.Value(name=f"{name}.hfused.split", const_value=ir.tensor(np.array(widths, np.int64), name=f"{name}.hfused.split"))
    sizes.type, sizes.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([len(widths)])
    graph.register_initializer(sizes)

    new_nodes = [ir.Node("", "MatMul", [x, w_cat], name=f"{name}.hfused")]
    fused = new_nodes[0].outputs[0]
    fused.name = f"{name}.hfused.out"
    olds = [n.outputs[0] for n in nodes]
    dead = list(nodes)
    if with_bias:
        b_cat = ir.Value(name=f"{name}.hfused.bias",
                         const_value=ir.tensor(_concat([b for _, b in biases], 0), name=f"{name}.hfused.bias"))
        b_cat.type, b_cat.shape = ir.TensorType(weights[0].dtype), ir.Shape(b_cat.const_value.shape)
        graph.register_initializer(b_cat)
        new_nodes.append(ir.Node("", "Add", [fused, b_cat], name=f"{name}.hfused.bias_add"))
        fused = new_nodes[-1].outputs[0]
        fused.name = f"{name}.hfused.biased"
        olds = [add.outputs[0] for add, _ in biases]
        dead += [add for add, _ in biases]
    split = ir.Node("", "Split", [fused, sizes], [ir.AttrInt64("axis", -1)], num_outputs=len(nodes),
                    name=f"{name}.hfused.split")
    new_nodes.append(split)
    fused.type = olds[0].type
    for old, new in zip(olds, split.outputs):
        new.name = f"{old.name}.hfused"
        new.type, new.shape = old.type, old.shape
    graph.insert_before(first, new_nodes)
    for old, new in zip(olds, split.outputs):
        replace_value(old, new)
    graph.remove(dead, safe=True)
    for value in [*weights, *([b for _, b in biases] if with_bias else [])]:
        if not value.uses() and value.name in graph.initializers:
            graph.initializers.pop(value.name)


def fuse_horizontal_matmul(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every group of MatMuls that share an input; returns the number of groups (QKV and gate/up: 2 a layer)."""
    groups = _groups(model.graph, trace)
    for nodes in groups:
        _fuse(model.graph, nodes)
    return len(groups)
