"""What every trtopt op shares: the domain, the schema types, node construction and function attachment.

A trtopt node in a plan's model.onnx is a plain NodeProto in domain ``trtopt`` (version 1) that always carries the
STRING attribute ``plugin_namespace="trtopt"`` (without it the TensorRT parser would inline the function body
instead of picking our plugin). The model also carries one local FunctionProto per trtopt op type used, written in
standard ONNX ops, so any ONNX runtime can execute the graph; ``attach_functions`` adds those.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import onnx
from onnx import TensorProto, helper

from trtopt.errors import BuildError

DOMAIN = "trtopt"
OPSET_VERSION = 1
PLUGIN_NAMESPACE = "trtopt"
# Function bodies need Shape(start, end) and CastLike (15); 17 is the oldest opset the bodies are tested on.
MIN_MODEL_OPSET = 17
# Initializers that stand for an absent optional input: float32 zeros, named by shape ("trtopt_zeros_1x1x1x1").
ZERO_INPUT_PREFIX = "trtopt_zeros_"
# Bodies mask hidden scores with the lowest finite float32, not −inf, so a row that sees no key gives no NaN.
LOWEST_FLOAT32 = -3.4028234663852886e38

# Node attributes that only steer TensorRT's parser; every trtopt function declares them so ORT and the checker
# accept them on the node, and the bodies ignore them.
TENSORRT_ATTRIBUTES: dict[str, type] = {"plugin_namespace": str, "plugin_version": str, "aot": int}

# A dimension: a known size, a symbolic name, or None when nothing is known.
Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class AttrSpec:
    """One attribute of a trtopt op. ``default`` None means the attribute is required."""

    name: str
    kind: type  # int, float or str: the ONNX attribute type it is written as
    default: int | float | str | None = None
    doc: str = ""
    # True: a node may leave it off, and it is then not written (the op reads ``default``): an attribute added after
    # plans were built (PagedAttention's FP8 KV scales) leaves the nodes of every plan that does not use it unchanged.
    omittable: bool = False


@dataclass(frozen=True)
class OpSchema:
    """Face 1 of docs/architecture.md §4: the op's I/O and attributes, and how output shapes follow from input
    shapes."""

    op_type: str
    inputs: tuple[str, ...]  # in node order
    # Optional inputs → shape of the float32 zeros that mean "absent" (from the node's attributes). A node may
    # leave them "" (or off the end); attach_functions then wires in a shared zero initializer (see there why).
    optional_inputs: Mapping[str, Callable[[Mapping[str, Any]], tuple[int, ...]]]
    outputs: tuple[str, ...]
    attributes: tuple[AttrSpec, ...]
    # (input shapes in node order, None for an absent/unknown input; normalized attributes) -> output shapes.
    # Raises BuildError when the shapes contradict each other or the attributes.
    infer_shapes: Callable[[Sequence[Shape | None], Mapping[str, Any]], list[Shape]] = field(repr=False)
    # True when trt_plugin.py registers a TensorRT plugin for the op. Only then do nodes carry plugin_namespace: the
    # TensorRT parser looks up a plugin for a node that carries it and inlines the function body for one that does not,
    # which is how ops without a kernel of their own (RMSNorm, MatMulAdd) reach TensorRT.
    tensorrt_plugin: bool = True


def expect_dim(op: str, what: str, actual: Dim, expected: Dim) -> None:
    """BuildError when two dims are both known and differ; symbolic or unknown dims are taken on trust."""
    if isinstance(actual, int) and isinstance(expected, int) and actual != expected:
        raise BuildError(
            f"{op}: {what} is {actual} but should be {expected}. The node's attributes and its input shapes "
            "disagree; fix the fusion rule (or the hand-written node) that set them."
        )


def gated_shape(op: str, gate: Shape | None, up: Shape | None) -> list[Shape]:
    """The one output shape of a gated pointwise op (SiluMul, GeluMul): gate's and up's, which must agree where
    both are known."""
    if gate is not None and up is not None:
        if len(gate) != len(up) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(gate, up)):
            raise BuildError(f"{op}: gate {tuple(gate)} and up {tuple(up)} must have one shape; fix the rule.")
    known = gate if gate is not None else up
    return [tuple(known) if known is not None else ()]


def expect_rank(op: str, name: str, shape: Shape | None, rank: int) -> Shape:
    if shape is None or len(shape) != rank:
        raise BuildError(f"{op}: input {name!r} must have rank {rank}, got shape {shape}.")
    return shape


def normalize_attributes(schema: OpSchema, attrs: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Check ``attrs`` against the schema, fill defaults, coerce to the declared kinds, set plugin_namespace on ops
    that have a TensorRT plugin (and drop it from ops that do not).

    Raises BuildError naming ``where`` (a node name or "make_node") for unknown or missing attributes.
    """
    unknown = set(attrs) - {a.name for a in schema.attributes} - set(TENSORRT_ATTRIBUTES)
    if unknown:
        raise BuildError(
            f"{where}: {schema.op_type} has no attribute(s) {sorted(unknown)}; it takes "
            f"{[a.name for a in schema.attributes]}. Fix the fusion rule or the hand-written node."
        )
    out: dict[str, Any] = {}
    for spec in schema.attributes:
        if spec.omittable and spec.name not in attrs:
            continue
        value = attrs.get(spec.name, spec.default)
        if value is None:
            raise BuildError(
                f"{where}: {schema.op_type} needs attribute {spec.name!r} ({spec.doc or spec.kind.__name__}). "
                "Set it on the node."
            )
        if isinstance(value, bytes):  # a STRING attribute as onnx.helper.get_attribute_value reads it
            value = value.decode()
        # A Python int scale would otherwise be written as an INT attribute and break the body's FLOAT reference.
        out[spec.name] = spec.kind(value)
    for name, kind in TENSORRT_ATTRIBUTES.items():
        if name in attrs:
            out[name] = kind(attrs[name])
    if schema.tensorrt_plugin:
        out["plugin_namespace"] = PLUGIN_NAMESPACE
    else:
        out.pop("plugin_namespace", None)
    return out


def make_node(
    op_type: str, inputs: Sequence[str], outputs: Sequence[str], *, name: str | None = None, **attrs: Any
) -> onnx.NodeProto:
    """A trtopt node: domain ``trtopt``, attributes checked against the op's schema with defaults filled,
    and ``plugin_namespace="trtopt"`` on ops with a TensorRT plugin so TensorRT picks it. Absent optional inputs are ""."""
    from trtopt.plugins import OP_SCHEMAS  # the registry imports this module, so look it up at call time

    assert op_type in OP_SCHEMAS, f"unknown trtopt op {op_type!r}; registered: {sorted(OP_SCHEMAS)}"
    schema = OP_SCHEMAS[op_type]
    assert len(inputs) <= len(schema.inputs) and len(outputs) == len(schema.outputs), (
        f"{op_type} takes inputs {schema.inputs} and outputs {schema.outputs}; got {list(inputs)} -> {list(outputs)}"
    )
    for formal, actual in zip(schema.inputs, inputs):
        assert actual or formal in schema.optional_inputs, f"{op_type}: input {formal!r} is required"
    normalized = normalize_attributes(schema, attrs, where=name or "make_node")
    return helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=DOMAIN, **normalized)


def default_opset(model: onnx.ModelProto) -> int:
    """The model's standard (ai.onnx) opset version; BuildError when it has none or one our bodies cannot use."""
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise BuildError("the model imports no standard ONNX opset; re-export it (opset 17 or newer).")
    opset = versions[0]
    if opset < MIN_MODEL_OPSET:
        raise BuildError(
            f"the model uses ONNX opset {opset}, but trtopt function bodies need opset >= {MIN_MODEL_OPSET}. "
            "Re-export with a newer opset or convert it with onnx.version_converter.convert_version."
        )
    return opset


def _trtopt_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every trtopt node in the graph and its subgraphs (If/Loop/Scan bodies)."""
    found = []
    for node in graph.node:
        if node.domain == DOMAIN:
            found.append(node)
        for attr in node.attribute:
            for sub in itertools.chain([attr.g] if attr.HasField("g") else [], attr.graphs):
                found.extend(_trtopt_nodes(sub))
    return found


def _known_shapes(graph: onnx.GraphProto) -> dict[str, Shape]:
    """Shapes the graph already declares (inputs, outputs, value_info, initializers); no inference is run."""
    shapes: dict[str, Shape] = {}
    for info in itertools.chain(graph.input, graph.output, graph.value_info):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shapes[info.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in info.type.tensor_type.shape.dim
            )
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _set_attributes(node: onnx.NodeProto, attrs: Mapping[str, Any]) -> None:
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())


def _fill_absent_inputs(
    model: onnx.ModelProto, node: onnx.NodeProto, schema: OpSchema, attrs: Mapping[str, Any]
) -> dict[str, Shape]:
    """Wire a shared float32 zero initializer into every absent optional input of ``node``; returns their shapes.

    Why not keep "": a function body cannot branch on whether an optional input was given (OptionalHasElement
    needs an optional-typed value before opset 18, and ORT rejects a "" reference even in an untaken If branch),
    and the one standard op whose optional input fits (LayerNormalization's B) crashes ORT's SkipLayerNormFusion
    when B is "" (it dereferences the missing input's type). TensorRT's Python plugins also take a fixed input
    list. Zeros are exactly "absent" for both ops (no ALiBi, no bias), so the node always has every input.
    """
    missing = [i for i in range(len(schema.inputs)) if i >= len(node.input) or not node.input[i]]
    if not missing:
        return {}
    wired: dict[str, Shape] = {}
    existing = {init.name for init in model.graph.initializer}
    while len(node.input) < len(schema.inputs):
        node.input.append("")
    for i in missing:
        shape = schema.optional_inputs[schema.inputs[i]](attrs)
        name = ZERO_INPUT_PREFIX + "x".join(map(str, shape))
        if name not in existing:
            model.graph.initializer.append(helper.make_tensor(name, TensorProto.FLOAT, shape, [0.0] * math.prod(shape)))
            existing.add(name)
        node.input[i] = name
        wired[name] = shape
    return wired


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make a graph with trtopt nodes executable by any ONNX runtime. Mutates ``model`` and returns it.

    For every trtopt op type used: add (or replace) its local FunctionProto, built for the model's own standard
    opset (the function's opset must equal the model's), and import the ``trtopt`` domain at version 1. Every trtopt
    node is validated against its schema: unknown ops and attributes raise BuildError, missing optional attributes
    get their defaults and ``plugin_namespace`` is set, absent optional inputs are replaced by a shared float32 zero
    initializer (see _fill_absent_inputs), and where the graph declares the input shapes the schema's shape
    inference checks that they agree with the attributes.
    """
    from trtopt.plugins import FUNCTION_BUILDERS, OP_SCHEMAS

    opset = default_opset(model)
    shapes = _known_shapes(model.graph)
    used: set[str] = set()
    for node in _trtopt_nodes(model.graph):
        where = f"node {node.name or node.output[0]!r}"
        if node.op_type not in OP_SCHEMAS or node.op_type not in FUNCTION_BUILDERS:
            raise BuildError(
                f"{where}: unknown trtopt op {node.op_type!r} (known: {sorted(OP_SCHEMAS)}). "
                "Register its schema and function builder in trtopt/plugins/__init__.py."
            )
        schema = OP_SCHEMAS[node.op_type]
        attrs = normalize_attributes(schema, {a.name: helper.get_attribute_value(a) for a in node.attribute},
                                     where=where)
        _set_attributes(node, attrs)
        required = [n for i, n in enumerate(schema.inputs) if n not in schema.optional_inputs
                    and (i >= len(node.input) or not node.input[i])]
        if len(node.input) > len(schema.inputs) or len(node.output) != len(schema.outputs) or required:
            raise BuildError(
                f"{where}: {node.op_type} takes inputs {list(schema.inputs)} (optional: "
                f"{sorted(schema.optional_inputs)}) and outputs {list(schema.outputs)}; the node has "
                f"{list(node.input)} -> {list(node.output)}. Fix the fusion rule that made it."
            )
        shapes.update(_fill_absent_inputs(model, node, schema, attrs))
        input_shapes = [shapes.get(name) for name in node.input]
        if all(shape is not None for shape in input_shapes):
            schema.infer_shapes(input_shapes, attrs)
        used.add(node.op_type)

    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name in used)]
    del model.functions[:]
    model.functions.extend(kept)
    model.functions.extend(FUNCTION_BUILDERS[op_type](opset) for op_type in sorted(used))
    if used:
        others = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend([*others, helper.make_opsetid(DOMAIN, OPSET_VERSION)])
    return model


# ---------------------------------------------------------------------------------------------------------------
# Writing function bodies.


class BodyBuilder:
    """A small helper to write a FunctionProto body as straight-line code: each call appends one node and returns
    its output name, so a body reads like the math it computes."""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._count = itertools.count()
        self._attrs: dict[str, str] = {}

    def op(self, op_type: str, *inputs: str, name: str | None = None, **attrs: Any) -> str:
        out = name or f"_{op_type.lower()}{next(self._count)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def ints(self, *values: int) -> str:
        """A 1-D int64 constant."""
        return self.op("Constant", value_ints=list(values))

    def int_scalar(self, value: int) -> str:
        return self.op("Constant", value_int=value)

    def float_scalar(self, value: float) -> str:
        return self.op("Constant", value_float=value)

    def attr(self, ref: str, kind: type) -> str:
        """A 0-D constant holding the calling node's attribute ``ref`` (an int64 or float32 scalar)."""
        if ref in self._attrs:
            return self._attrs[ref]
        attr_name, attr_type = ("value_int", onnx.AttributeProto.INT) if kind is int else \
            ("value_float", onnx.AttributeProto.FLOAT)
        out = f"_attr_{ref}"
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(helper.make_attribute_ref(attr_name, attr_type, ref_attr_name=ref))
        self.nodes.append(node)
        self._attrs[ref] = out
        return out

    def dim(self, x: str, axis: int) -> str:
        """Size of ``x`` along ``axis`` (>= 0) as a 1-D int64 [1] (Reshape/Concat-ready)."""
        assert axis >= 0, "count axes from the front: Shape(start=-1, end=0) would be empty"
        return self.op("Shape", x, start=axis, end=axis + 1)

    def scalar(self, x: str) -> str:
        """[1] → 0-D."""
        return self.op("Squeeze", x, self.ints(0))

    def reduce_max(self, x: str, axis: int, keepdims: int = 0) -> str:
        # ReduceMax took its axes as an attribute up to opset 17 and as an input from 18 on.
        if self.opset >= 18:
            return self.op("ReduceMax", x, self.ints(axis), keepdims=keepdims)
        return self.op("ReduceMax", x, axes=[axis], keepdims=keepdims)

    def function(self, name: str, inputs: Sequence[str], outputs: Sequence[str], attributes: Sequence[str],
                 doc: str) -> onnx.FunctionProto:
        return helper.make_function(
            DOMAIN, name, list(inputs), list(outputs), self.nodes,
            opset_imports=[helper.make_opsetid("", self.opset)],
            attributes=[*attributes, *TENSORRT_ATTRIBUTES], doc_string=doc,
        )

