"""Reading constants, permutations and shapes off an onnx-ir graph, and adding small initializers: the graph
helpers that the rules share (attention matching, the norms, the paged rewrite's shape rebinding)."""

from __future__ import annotations

import contextlib
import tempfile

import numpy as np
import onnx_ir as ir

from trtopt.plugins.common import DOMAIN

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def is_op(node: ir.Node | None, op_type: str) -> bool:
    """A node of the standard ONNX domain with this op_type (None is none): what every matcher asks first."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def projection_weight(node: ir.Node | None) -> ir.TensorProtocol | None:
    """The constant [K, N] weight of a projection ``x @ W`` (a standard MatMul or trtopt.MatMulAdd), else None."""
    if not (is_op(node, "MatMul") or (node is not None and node.domain == DOMAIN and node.op_type == "MatMulAdd")):
        return None
    w = node.inputs[1].const_value if node.inputs[1] is not None else None
    return w if w is not None and len(w.shape) == 2 else None


def _constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor behind an initializer or a Constant node's ``value``, else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            tensor = producer.attributes["value"].value
    return tensor


def is_constant(value: ir.Value | None) -> bool:
    """An initializer or a Constant node's output."""
    return _constant_tensor(value) is not None


def scalar_constant(value: ir.Value | None) -> float | None:
    """The float value of a one-element constant (initializer or Constant node), else None."""
    tensor = _constant_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    if array.size != 1:
        return None
    return float(array.reshape(()))


def int_list_constant(value: ir.Value | None) -> list[int] | None:
    """The flattened integer values of a constant (initializer or Constant node), else None."""
    tensor = _constant_tensor(value)
    if tensor is None:
        return None
    return [int(x) for x in np.asarray(tensor.numpy()).reshape(-1)]


def perm(node: ir.Node) -> tuple[int, ...] | None:
    """A Transpose's ``perm`` attribute, or None when it has none (the default reverses the axes)."""
    attr = node.attributes.get("perm")
    return tuple(attr.value) if attr is not None else None


def is_float_cast(node: ir.Node | None) -> bool:
    """A Cast to a float type: exporters wrap fp16 attention in fp32 casts; the ops accumulate in fp32."""
    return node is not None and node.op_type == "Cast" and node.attributes["to"].value in FLOAT_TYPES


def same_dims(a, b) -> bool:
    """Equal static sizes, or the same named symbol (the exporter's shape inference says they are equal)."""
    return _known_dim(a) and _known_dim(b) and a == b


def _known_dim(dim) -> bool:
    return isinstance(dim, int) or (isinstance(dim, ir.SymbolicDim) and dim.value is not None)


def int64_initializer(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    """A 1-D int64 initializer registered on ``graph`` (shape vectors, axes)."""
    value = ir.Value(name=name, const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))
    value.shape, value.type = ir.Shape([len(values)]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(value)
    return value


def initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    """Register ``array``, cast to ``dtype``, as the initializer ``name`` of ``graph``."""
    tensor = array.astype(dtype.numpy())
    value = ir.Value(name=name, const_value=ir.tensor(tensor, name=name))
    value.shape, value.type = ir.Shape(list(tensor.shape)), ir.TensorType(dtype)
    graph.register_initializer(value)
    return value


def binary_node(op: str, x: ir.Value, b: ir.Value, name: str) -> ir.Node:
    """A new (not inserted) ``op``(x, b) node whose output, named ``name``, has x's shape and type."""
    node = ir.node(op, [x, b], name=name)
    node.outputs[0].name = name
    node.outputs[0].shape, node.outputs[0].type = x.shape, x.type
    return node


def infer_missing_shapes(model: ir.Model) -> int:
    """Give intermediate values whose shape is missing or partly unknown the one onnxruntime's symbolic shape inference derives (it
    propagates shape arithmetic, so `[B·H, S, D]` folds come out as `4*batch_size`, ...); returns how many got one.

    TorchScript-traced exports (the legacy exporter, optimum) carry no intermediate shapes, and some proofs (BLOOM's
    head folds) need them. This serialises the whole model, so callers use it only where a proof failed without it.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    proto = ir.to_proto(model)
    _constants_as_tensors(proto.graph)
    # When it cannot infer every shape, it saves its partial model as sym_shape_infer_temp.onnx (+ a .data file)
    # into the working directory before raising: run it in a scratch directory so a build leaves nothing behind
    # in the user's. (chdir is process-wide; the build runs its passes on one thread.)
    with tempfile.TemporaryDirectory(prefix="trtopt-shape-infer-") as scratch, contextlib.chdir(scratch):
        try:
            inferred = SymbolicShapeInference.infer_shapes(proto, auto_merge=True)
        except Exception:  # it raises many types on graphs it cannot follow; then nothing is added
            return 0
    values = {v.name: v for node in model.graph for v in node.outputs}
    count = 0
    for info in inferred.graph.value_info:
        value = values.get(info.name)
        if value is None or _complete(value.shape) or not info.type.tensor_type.HasField("shape"):
            continue
        found = ir.serde.deserialize_value_info_proto(info, None)
        value.shape = found.shape
        value.type = value.type or found.type
        count += 1
    return count


def _complete(shape: ir.Shape | None) -> bool:
    return shape is not None and all(_known_dim(d) for d in shape)


def _constants_as_tensors(graph) -> None:
    """Constant(value_int[s]/value_float[s]) → Constant(value=tensor): the symbolic shape inference reads only
    ``value`` (onnxscript's folding writes the other forms)."""
    import onnx

    for node in graph.node:
        if node.op_type != "Constant" or any(a.name == "value" for a in node.attribute):
            continue
        (attr,) = node.attribute
        array = np.asarray(onnx.helper.get_attribute_value(attr),
                           dtype=np.int64 if attr.name.startswith("value_int") else np.float32)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(array)))
