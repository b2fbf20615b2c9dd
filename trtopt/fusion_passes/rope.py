"""Rule: the exported rotary embedding subgraph → trtopt.Rope (a build pass; it was the torch executor's fx rewrite).

    y = x·cos + Concat(Neg(Slice(x, half:end)), Slice(x, 0:half), axis=-1)·sin      →      y = Rope(x, cos, sin)

as both exporters write HF's ``apply_rotary_pos_emb`` (7 ops for q and 7 for k in every layer). Both operand orders
of the Muls and the Add are matched; ``half`` is a constant (dynamo exports) or computed from x's shape as
``Unsqueeze(Div(Gather(Shape(x), axis), 2), [0])`` (TorchScript exports), which becomes ``half=0`` (D // 2 at run
time). The slices must be step-1 slices of x along its last axis, the upper one running to the end.

Runs after the attention rewrite, whose proofs walk the exported RoPE ops (the paged rewrite's head-agnostic paths).
ONNX's own RotaryEmbedding exists only from opset 23; the opset-23 exports already carry it and are left alone.
A region that has the Concat(Neg(Slice), Slice) shape but fails a check is recorded in the trace for ``--explain``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import int_list_constant, is_op, scalar_constant
from trtopt.fusion_passes.ops import DOMAIN, declare_domain, replace_output
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "rope"
_TO_THE_END = 2**31  # an upper Slice end at least this large runs to the end of any real head dim


@dataclasses.dataclass(frozen=True)
class _Match:
    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    half: int  # 0: x.shape[-1] // 2 at run time
    nodes: tuple[ir.Node, ...]  # the matched nodes, the Add first


def _operand_pairs(node: ir.Node | None, op_type: str) -> list[tuple[ir.Value, ir.Value]]:
    if not is_op(node, op_type) or len(node.inputs) != 2:
        return []
    a, b = node.inputs
    return [(a, b), (b, a)]


def _slice(value: ir.Value) -> tuple[ir.Node, ir.Value, object, object, int]:
    """(node, data, start, end, axis) of a one-axis step-1 Slice; start/end are ints or the Value computing them."""
    node = value.producer()
    if not is_op(node, "Slice") or len(node.inputs) < 4:
        raise NoMatch("an operand of the rotation is not a Slice with axes", getattr(node, "name", "") or "")
    axes = int_list_constant(node.inputs[3])
    steps = int_list_constant(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if axes is None or len(axes) != 1 or steps != [1]:
        raise NoMatch("a Slice is not a step-1 slice of one constant axis", node.name or "")
    bounds = []
    for v in node.inputs[1:3]:
        c = int_list_constant(v)
        bounds.append(c[0] if c is not None and len(c) == 1 else v)
    return node, node.inputs[0], bounds[0], bounds[1], axes[0]


# Ops whose output has the rank of their first input (Reduce* only with keepdims, checked below), and the
# broadcasting ops whose output has the largest rank of their inputs.
_RANK_OF_INPUT = frozenset({"Cast", "CastLike", "Identity", "Neg", "Sqrt", "Reciprocal", "Abs", "Exp", "Log", "Tanh",
                            "Erf", "Relu", "Sigmoid", "Softmax", "ReduceMean", "ReduceSum", "ReduceSumSquare",
                            "ReduceMax", "ReduceL2"})
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where"})
_RANK_WALK_DEPTH = 24  # a q/k norm between the head Transpose and the rotation is ~10 ops deep


def _rank(x: ir.Value, depth: int = 0, memo: dict | None = None) -> int | None:
    """x's rank: from its shape, or (the paged rewrite clears shapes) from the Transpose or Reshape producing it,
    through rank-preserving and broadcasting ops between them (Gemma-3 rotates the output of its q/k RMSNorm).
    ``memo`` holds the values already walked, so a DAG (x read twice by a norm) is walked once per value."""
    memo = {} if memo is None else memo
    if id(x) not in memo:
        memo[id(x)] = _walk_rank(x, depth, memo)
    return memo[id(x)]


def _walk_rank(x: ir.Value, depth: int, memo: dict) -> int | None:
    if x.shape is not None:
        return len(x.shape)
    if x.const_value is not None:
        return len(x.const_value.shape)
    node = x.producer()
    if node is None or depth > _RANK_WALK_DEPTH:
        return None
    if is_op(node, "Transpose") and "perm" in node.attributes:
        return len(node.attributes["perm"].value)
    if is_op(node, "Reshape"):
        target = int_list_constant(node.inputs[1])
        return len(target) if target is not None else None
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in _RANK_OF_INPUT and node.inputs and node.inputs[0] is not None:
        if node.op_type.startswith("Reduce") and ("keepdims" in node.attributes
                                                  and node.attributes["keepdims"].value == 0):
            return None
        return _rank(node.inputs[0], depth + 1, memo)
    if node.op_type in _BROADCASTING:
        ranks = [_rank(v, depth + 1, memo) if v is not None else None for v in node.inputs]
        return None if None in ranks else max(ranks)
    return None


def _last_axis(axis: int, x: ir.Value) -> bool:
    return axis == -1 or axis == _rank(x) - 1 if _rank(x) is not None else axis == -1


def _half_of_dim(value: ir.Value, x: ir.Value, axis: int) -> list[ir.Node]:
    """The nodes of ``Unsqueeze(Div(Gather(Shape(x), axis), 2), [0])``; NoMatch otherwise."""
    unsq = value.producer()
    div = unsq.inputs[0].producer() if is_op(unsq, "Unsqueeze") and int_list_constant(unsq.inputs[1]) == [0] else None
    gather = div.inputs[0].producer() if is_op(div, "Div") and scalar_constant(div.inputs[1]) == 2 else None
    shape = gather.inputs[0].producer() if is_op(gather, "Gather") and int_list_constant(gather.inputs[1]) == [axis] \
        else None
    if not (is_op(shape, "Shape") and shape.inputs[0] is x and not shape.attributes):
        raise NoMatch("the split point is neither a constant nor x.shape[axis] / 2", getattr(unsq, "name", "") or "")
    return [unsq, div, gather, shape]


def _rotation(cat: ir.Node, x: ir.Value) -> tuple[int, list[ir.Node]]:
    """(half, nodes) of ``Concat(Neg(Slice(x, half:end)), Slice(x, 0:half), axis=last)``; NoMatch says why not."""
    neg = cat.inputs[0].producer()
    if not is_op(neg, "Neg"):
        raise NoMatch("the Concat's first operand is not a Neg", cat.name or "")
    hi, hi_x, hi_start, hi_end, hi_axis = _slice(neg.inputs[0])
    lo, lo_x, lo_start, lo_end, lo_axis = _slice(cat.inputs[1])
    if hi_x is not x or lo_x is not x:
        raise NoMatch("the rotated halves are not slices of the tensor multiplied by cos", cat.name or "")
    cat_axis = cat.attributes["axis"].value
    if not (hi_axis == lo_axis and _last_axis(lo_axis, x) and _last_axis(cat_axis, x)):
        raise NoMatch(f"the slices (axes {lo_axis}, {hi_axis}) and the Concat (axis {cat_axis}) are not all along "
                      "x's last axis", cat.name or "")
    if lo_start != 0 or not (hi_start is lo_end or (isinstance(lo_end, int) and hi_start == lo_end)):
        raise NoMatch("the two slices are not [0:half] and [half:]", cat.name or "")
    if not isinstance(hi_end, int) or hi_end < _TO_THE_END:
        raise NoMatch(f"the upper slice ends at {hi_end}, not at the end of the axis", hi.name or "")
    nodes = [cat, neg, hi, lo]
    if isinstance(lo_end, int):
        if lo_end <= 0:
            raise NoMatch(f"the split point {lo_end} is not positive", lo.name or "")
        return lo_end, nodes
    return 0, nodes + _half_of_dim(lo_end, x, lo_axis)


def _match(add: ir.Node) -> _Match | None:
    """The RoPE region whose final Add this is, or None; NoMatch when it has the rotation's shape but fails a check."""
    for m1, m2 in (add.inputs, add.inputs[::-1]):
        for x, cos in _operand_pairs(m1.producer() if m1 is not None else None, "Mul"):
            for rotated, sin in _operand_pairs(m2.producer() if m2 is not None else None, "Mul"):
                cat = rotated.producer()
                if not (is_op(cat, "Concat") and len(cat.inputs) == 2 and is_op(cat.inputs[0].producer(), "Neg")):
                    continue
                if cat.inputs[1].producer() is None or cat.inputs[1].producer().inputs[0] is not x:
                    continue  # this x is the other operand (cos); the loop tries the swapped order
                half, nodes = _rotation(cat, x)
                return _Match(x, cos, sin, half, (add, m1.producer(), m2.producer(), *nodes))
    return None


def _remove_dead(graph: ir.Graph, nodes: tuple[ir.Node, ...]) -> None:
    """Remove the matched nodes nothing reads any more (consumers first: ``nodes`` are in consumer → producer order)."""
    for node in nodes:
        if node.graph is graph and all(not o.uses() and not o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def fuse_rope(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every exported RoPE subgraph into trtopt.Rope; returns the count (q and k: 2 per layer)."""
    graph = model.graph
    count = 0
    for add in [n for n in graph if is_op(n, "Add") and len(n.inputs) == 2]:
        try:
            found = _match(add)
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, add.name or "", e)
            continue
        if found is None:
            continue
        old = add.outputs[0]
        # No plugin_namespace: Rope has no TensorRT plugin, so TensorRT must inline its body (trt_plugin.py).
        node = ir.Node(DOMAIN, "Rope", [found.x, found.cos, found.sin], [ir.AttrInt64("half", found.half)],
                       num_outputs=1, name=f"{add.name or old.name}.rope")
        graph.insert_before(add, node)
        replace_output(old, node.outputs[0], "rope")
        _remove_dead(graph, found.nodes)
        count += 1
    if count:
        declare_domain(model)
    return count
