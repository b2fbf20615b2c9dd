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

Quantized projections (trtopt.QMatMul, docs/architecture.md §4) group the same way, apart from the MatMuls, when
they read one x with one quantization: weight dtype, K, axis, block_size, scale dtype, act_mode, act_block_size,
and the same activation scale and zero point (one value, equal constants, or for per-token scales the same
computation of x). Their w_q, w_scale and w_zero_point are concatenated along N (the last axis of each: [K, N],
[N] or [K/G, N]) into one QMatMul, whose node metadata ``MEMBERS_KEY`` names the QMatMuls it replaced and their
widths (`members` reads it back: trtopt/quantize/sensitivity.py maps a plan's weights to the float MatMuls).
Members of another quantization stay apart, with the reason in the trace.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import is_op
from trtopt.fusion_passes.ops import DOMAIN, replace_value
from trtopt.fusion_passes.qmatmul import ACT_SCALE, ACT_ZERO_POINT, W_Q, W_SCALE, W_ZERO_POINT, is_quantized_projection
from trtopt.fusion_passes.trace import NoMatch, Trace
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, OP_TYPE as QMATMUL

RULE = "horizontal_matmul"
MEMBERS_KEY = "trtopt.horizontal_members"  # a fused QMatMul's metadata: JSON [[member node name, N], ...]
_SAME_COMPUTATION_DEPTH = 8  # how far up two per-token scale computations are compared


def _weight(node: ir.Node) -> ir.Value | None:
    """The constant [K, N] weight of `x @ W`, or None."""
    if not is_op(node, "MatMul") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    return w


def _float_dtype(node: ir.Node) -> ir.DataType:
    """The dtype of the projection's output (and of a bias after it): a MatMul's weight's, a QMatMul's scale's."""
    return node.inputs[W_SCALE if is_quantized_projection(node) else 1].const_value.dtype


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
    if c is None or tuple(c.shape) != (width,) or c.dtype != _float_dtype(node):
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


# ---- quantized projections ----------------------------------------------------------------------------------------


def _constant_key(value: ir.Value | None) -> tuple | None:
    c = value.const_value if value is not None else None
    return None if c is None else (c.dtype, tuple(c.shape), c.numpy().tobytes())


def _same_computation(a: ir.Value | None, b: ir.Value | None, depth: int = _SAME_COMPUTATION_DEPTH) -> bool:
    """``a`` and ``b`` are one value, equal constants, or the same ops (attributes included) over such inputs."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    if a.const_value is not None or b.const_value is not None:
        return _constant_key(a) == _constant_key(b)
    pa, pb = a.producer(), b.producer()
    if depth == 0 or pa is None or pb is None or a.index() != b.index():
        return False
    return ((pa.domain, pa.op_type, len(pa.inputs)) == (pb.domain, pb.op_type, len(pb.inputs))
            and {k: str(v) for k, v in pa.attributes.items()} == {k: str(v) for k, v in pb.attributes.items()}
            and all(_same_computation(x, y, depth - 1) for x, y in zip(pa.inputs, pb.inputs)))


def _quantization(node: ir.Node) -> tuple:
    """What a QMatMul's concatenation partners must share, the activation scale and zero point aside."""
    w_q, scale = node.inputs[W_Q].const_value, node.inputs[W_SCALE].const_value
    attrs = tuple(int(node.attributes[a].value) if a in node.attributes else 0
                  for a in ("axis", "block_size", "act_mode", "act_block_size", "weight_dtype"))
    return (w_q.dtype, int(w_q.shape[0]), scale.dtype, len(scale.shape), *attrs, *node.inputs[ACT_ZERO_POINT + 1:])


def _same_activation(a: ir.Node, b: ir.Node) -> bool:
    """One activation quantization: the same scale and zero point (static: one value or equal constants; dynamic:
    the same computation of x, per token)."""
    sa, sb = a.inputs[ACT_SCALE], b.inputs[ACT_SCALE]
    dynamic = int(a.attributes["act_mode"].value) == ACT_DYNAMIC if "act_mode" in a.attributes else False
    same_scale = _same_computation(sa, sb) if dynamic else (
        sa is sb or (_constant_key(sa) is not None and _constant_key(sa) == _constant_key(sb)))
    za, zb = a.inputs[ACT_ZERO_POINT], b.inputs[ACT_ZERO_POINT]
    return same_scale and (za is zb or (_constant_key(za) is not None and _constant_key(za) == _constant_key(zb)))


def _qmatmul_groups(graph: ir.Graph, trace: Trace | None) -> list[list[ir.Node]]:
    """QMatMuls of one x, partitioned by quantization; every part of two or more is a group."""
    by_input: dict[ir.Value, list[ir.Node]] = {}
    for node in graph:
        if is_quantized_projection(node):
            by_input.setdefault(node.inputs[0], []).append(node)
    groups = []
    for nodes in by_input.values():
        if len(nodes) < 2:
            continue
        parts: list[list[ir.Node]] = []
        for node in nodes:
            part = next((p for p in parts if _quantization(p[0]) == _quantization(node)
                         and _same_activation(p[0], node)), None)
            if part is None:
                parts.append([node])
            else:
                part.append(node)
        groups += [p for p in parts if len(p) > 1]
        if len(parts) > 1 and trace is not None:
            kept = ", ".join(p[0].name or "" for p in parts if len(p) == 1)
            trace.fail(RULE, nodes[0].name or "", NoMatch(
                f"the {len(nodes)} QMatMuls of one input differ in weight dtype, K, block size or activation "
                f"quantization ({len(parts)} kinds); fused only within a kind" + (f", {kept} left apart" if kept
                                                                                     else "")))
    return groups


def members(node: onnx.NodeProto) -> list[tuple[str, int]] | None:
    """The (QMatMul name, N) that a fused QMatMul replaced, in column order; None for a node this rule did not
    make."""
    meta = {p.key: p.value for p in node.metadata_props}
    if MEMBERS_KEY not in meta:
        return None
    return [(str(name), int(width)) for name, width in json.loads(meta[MEMBERS_KEY])]


# ---- the rewrite ---------------------------------------------------------------------------------------------------


# A joined initializer's name -> the initializers it concatenates (in order), the axis, and each one's width along
# it (fuse_horizontal_matmul's ``sources``: a tensor-parallel build joins each rank's own slices the same way,
# builder/sharding/analysis.py).
Sources = dict[str, tuple[tuple[str, ...], int, tuple[int, ...]]]


def _initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, dtype=dtype, name=name))
    value.type, value.shape = ir.TensorType(dtype), ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def _joined(graph: ir.Graph, name: str, values: list[ir.Value], axis: int, sources: Sources | None) -> ir.Value:
    """The initializer ``name`` holding ``values`` concatenated along ``axis`` (recorded in ``sources``)."""
    array = np.concatenate([v.const_value.numpy() for v in values], axis=axis)
    if sources is not None:
        sources[name] = (tuple(v.name for v in values), axis, tuple(v.const_value.shape[axis] for v in values))
    return _initializer(graph, name, array, values[0].const_value.dtype)


def _product(graph: ir.Graph, nodes: list[ir.Node], name: str,
             sources: Sources | None) -> tuple[ir.Node, list[ir.Value], list[int]]:
    """The one node computing every member's columns side by side; the constants it replaces; each member's N."""
    first = nodes[0]
    if not is_quantized_projection(first):
        weights = [n.inputs[1] for n in nodes]
        w_cat = _joined(graph, f"{name}.hfused.weight", weights, 1, sources)
        return ir.Node("", "MatMul", [first.inputs[0], w_cat], name=f"{name}.hfused"), weights, \
            [w.const_value.shape[1] for w in weights]
    # w_q [K, N], w_scale and w_zero_point [N] or [K/G, N]: N is the last axis of each.
    inputs, replaced = list(first.inputs), []
    for i, part in ((W_Q, "weight_quantized"), (W_SCALE, "weight_scale"), (W_ZERO_POINT, "weight_zero_point")):
        values = [n.inputs[i] for n in nodes]
        rank = len(values[0].const_value.shape)
        inputs[i] = _joined(graph, f"{name}.hfused.{part}", values, rank - 1, sources)
        replaced += values
    widths = [int(n.inputs[W_Q].const_value.shape[1]) for n in nodes]
    attrs = [ir.Attr(a.name, a.type, a.value) for a in first.attributes.values()]
    node = ir.Node(DOMAIN, QMATMUL, inputs, attrs, name=f"{name}.hfused")
    node.metadata_props[MEMBERS_KEY] = json.dumps([[n.name or "", w] for n, w in zip(nodes, widths)])
    return node, replaced, widths


def _fuse(graph: ir.Graph, nodes: list[ir.Node], sources: Sources | None) -> None:
    first = nodes[0]
    name = first.name or first.outputs[0].name
    product, constants, widths = _product(graph, nodes, name, sources)
    biases = [_bias_add(n, width) for n, width in zip(nodes, widths)]
    with_bias = all(b is not None for b in biases)
    sizes = _initializer(graph, f"{name}.hfused.split", np.array(widths, np.int64), ir.DataType.INT64)

    new_nodes = [product]
    fused = product.outputs[0]
    fused.name = f"{name}.hfused.out"
    olds = [n.outputs[0] for n in nodes]
    dead = list(nodes)
    if with_bias:
        b_cat = _joined(graph, f"{name}.hfused.bias", [b for _, b in biases], 0, sources)
        new_nodes.append(ir.Node("", "Add", [fused, b_cat], name=f"{name}.hfused.bias_add"))
        fused = new_nodes[-1].outputs[0]
        fused.name = f"{name}.hfused.biased"
        olds = [add.outputs[0] for add, _ in biases]
        dead += [add for add, _ in biases]
        constants += [b for _, b in biases]
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
    for value in constants:
        if not value.uses() and value.name in graph.initializers:
            graph.initializers.pop(value.name)


def fuse_horizontal_matmul(model: ir.Model, trace: Trace | None = None, *, sources: Sources | None = None) -> int:
    """Fuse every group of MatMuls (and of like-quantized QMatMuls) that share an input; returns the number of
    groups (QKV and gate/up: 2 a layer). ``sources``, when given, gets each joined initializer's members."""
    groups = _groups(model.graph, trace) + _qmatmul_groups(model.graph, trace)
    for nodes in groups:
        _fuse(model.graph, nodes, sources)
    return len(groups)
