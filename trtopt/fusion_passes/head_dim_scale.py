"""Attention scales that an exporter computes from a shape instead of writing a constant.

torch's SDPA without an explicit ``scale`` uses ``1/√q.size(-1)``; when the query's shape is not static in the
trace (optimum's Falcon, StableLM, GPT-2 exports), the graph computes it at run time, e.g.

    Sqrt(Div(1, Sqrt(Cast(Slice(Shape(q), -1, ∞)))))      (√scale, applied to both q and kᵀ)

Such a factor is accepted only when it is provably a scalar function of the head dim: its subgraph reads nothing
but constants and ``Shape`` of one tensor whose last dim is the head dim (an operand of QKᵀ, so its last dim is the
contraction dim). It is then *evaluated* for the head dim that the rest of the proof establishes (the cache inputs'
static dims, or config.json), twice with different values for every other dim, and refused unless both give the
same scalar: what the graph would compute, independent of batch, heads and lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from trtopt.fusion_passes.trace import NoMatch

# A shape-to-scale chain is a handful of nodes (Shape, Slice/Gather, Cast, Sqrt, Div, Sqrt); more is not a scale.
_MAX_NODES = 16
_OTHER_DIMS = ((1, 1, 1), (3, 5, 7))  # two unrelated fillings of B, H, S: the scale must not depend on them
_RANK = 4  # q and k are [B, H, S, D] where the factor is applied (when the source has no shape)


@dataclasses.dataclass(frozen=True)
class HeadDimFactor:
    """A scalar factor of the scores computed from ``Shape(source)``, proven to read only shapes of ``source``."""

    value: ir.Value  # the factor (one element)
    source: ir.Value  # the tensor whose shape it reads

    def evaluate(self, head_dim: int) -> float:
        """The factor's value for this head dim; NoMatch when it depends on anything else or is not a scalar."""
        nodes, shapes = _subgraph(self.value)
        rank = len(self.source.shape) if self.source.shape is not None else _RANK
        results = []
        for others in _OTHER_DIMS:
            dims = np.array([*others[: rank - 1], head_dim], dtype=np.int64)
            feeds = {shape.outputs[0].name: dims[_shape_range(shape)] for shape in shapes}
            results.append(_run(nodes, shapes, self.value, feeds))
        if any(r.size != 1 for r in results) or not np.array_equal(results[0], results[1]):
            raise NoMatch(f"the scale factor {self.value.name} is not one scalar that depends only on the head dim")
        return float(results[0].reshape(()))


def head_dim_factor(value: ir.Value) -> HeadDimFactor | None:
    """``value`` as a HeadDimFactor when its subgraph is constants and Shape nodes of a single tensor, else None."""
    try:
        _, shapes = _subgraph(value)
    except NoMatch:
        return None
    sources = {id(node.inputs[0]) for node in shapes}
    if len(sources) != 1:
        return None
    return HeadDimFactor(value, shapes[0].inputs[0])


def _shape_range(node: ir.Node) -> slice:
    start = node.attributes["start"].value if "start" in node.attributes else None
    end = node.attributes["end"].value if "end" in node.attributes else None
    return slice(start, end)


def _subgraph(value: ir.Value) -> tuple[list[ir.Node], list[ir.Node]]:
    """(the nodes computing ``value`` from constants and Shape outputs, in graph order; the Shape nodes)."""
    nodes: dict[int, ir.Node] = {}
    shapes: dict[int, ir.Node] = {}
    stack = [value]
    while stack:
        current = stack.pop()
        if current is None or current.const_value is not None:
            continue
        node = current.producer()
        if node is None:
            raise NoMatch(f"the scale reads the graph input {current.name}")
        if node.op_type == "Shape":
            shapes[id(node)] = node
            continue
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        if len(nodes) > _MAX_NODES:
            raise NoMatch("the scale subgraph is too large to be a shape expression")
        stack.extend(node.inputs)
    if not shapes:
        raise NoMatch("the scale does not read a shape")
    graph = value.producer().graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    return sorted(nodes.values(), key=lambda n: order.get(id(n), 0)), list(shapes.values())


def _run(nodes: list[ir.Node], shapes: list[ir.Node], target: ir.Value, feeds: dict[str, np.ndarray]) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    inputs = [onnx.helper.make_tensor_value_info(s.outputs[0].name, onnx.TensorProto.INT64, None) for s in shapes]
    initializers = []
    seen: set[str] = set()
    for node in nodes:
        for value in node.inputs:
            if value is not None and value.const_value is not None and value.name not in seen:
                seen.add(value.name)
                initializers.append(onnx.numpy_helper.from_array(value.const_value.numpy(), value.name))
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "head_dim_scale", inputs,
        [onnx.helper.make_value_info(target.name, onnx.TypeProto())], initializers,
    )
    opset = nodes[0].graph.opset_imports.get("", 18) if nodes and nodes[0].graph is not None else 18
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        (result,) = ReferenceEvaluator(model).run(None, feeds)
    except Exception as e:  # the reference evaluator raises many types; any failure means "not proven"
        raise NoMatch(f"the scale subgraph of {target.name} does not evaluate ({type(e).__name__}: {e})") from e
    return np.asarray(result)
