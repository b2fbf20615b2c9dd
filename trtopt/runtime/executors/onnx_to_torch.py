"""An in-house onnx-ir → torch.fx converter (docs/architecture.md §5, torch executor).

onnx2torch fails on every dynamo export, so trtopt converts graphs itself. The result is a straight-line
``torch.fx.GraphModule``: one call per ONNX node, weights as buffers (their dtypes kept), graph inputs as
positional arguments in ONNX order, graph outputs as a tuple in ONNX order.

Work done once at conversion instead of at every step:
- constant folding: a node whose inputs are all constants is evaluated now (RoPE tables, masks of constants...);
- shape folding: ``Shape`` of a value whose dims are static becomes a constant;
- constant shape-like inputs (Reshape's shape, Slice's starts...) are baked into the call as Python lists;
- common subexpressions (the same pure op on the same inputs, e.g. per-layer copies of one shape computation)
  are computed once.

Placement (device != cpu): Shape and Size produce host (CPU) tensors, and a standard op whose runtime inputs are
all host runs on the host too, so shape arithmetic never syncs with the GPU. Host constants stay on the CPU; a
device op that reads a host value as data gets an explicit transfer (read as a shape-like list it needs none).

trtopt-domain ops dispatch to ``trtopt_ops`` (Triton kernels on CUDA; on CPU, plugins/paged_attention/cpu.py's
SDPA path for PagedAttention and the torch references for the rest); PagedAttention
writes the KV pool passed in as a graph input IN PLACE and returns that same tensor as ``kv_cache_out``; given a
``paged_state`` (the torch executor's PagedLaunchState), the module holds it as the attribute ``paged_state`` and
every PagedAttention call reads it from there (``state=``). Any other model-local function (a trtopt op without a
torch implementation) is inlined from its ONNX body.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection

import numpy as np
import onnx_ir as ir
import torch
import torch.fx

from trtopt.errors import BuildError
from trtopt.plugins.common import ZERO_INPUT_PREFIX
from trtopt.runtime.executors.onnx_ops import MIN_OPSET, ONNX_TO_TORCH_DTYPE, STANDARD_OPS, OpSpec, as_ints
from trtopt.runtime.executors.trtopt_ops import IMPURE_OPS, REFERENCE_OPS, TRTOPT_OPS

if TYPE_CHECKING:
    from trtopt.plugins.paged_attention.planning import PagedLaunchState

# Attributes that only address other consumers (the TensorRT parser) and never change the op's meaning.
_IGNORED_ATTRS = frozenset({"plugin_namespace", "plugin_version", "aot"})
# Contrib ops that exported graphs sometimes carry and that have an exact standard meaning.
_CONTRIB_OPS = {("com.microsoft", "SimplifiedLayerNormalization"): STANDARD_OPS["SimplifiedLayerNormalization"]}


class UnsupportedOpError(BuildError):
    """The graph holds an op (or an attribute of one) that the torch converter cannot run."""


@dataclasses.dataclass
class ConvertedGraph:
    """A converted model: call ``module(*inputs)`` with the tensors of ``input_names``, in that order."""

    module: torch.fx.GraphModule
    input_names: list[str]  # ONNX graph input names, the module's positional arguments in order
    output_names: list[str]  # ONNX graph output names, the order of the returned tuple
    opset: int  # the model's default-domain opset


@dataclasses.dataclass(frozen=True)
class _Const:
    """A value known at conversion time."""

    tensor: torch.Tensor


_Value = _Const | torch.fx.Node | None


# Packed 4-bit initializers → the numpy dtype they are unpacked to (torch has no 4-bit tensors).
_UNPACKED_DTYPES = {ir.DataType.INT4: np.int8, ir.DataType.UINT4: np.uint8}


def ir_tensor_to_torch(tensor: ir.TensorProtocol) -> torch.Tensor:
    """Copy an onnx-ir tensor (in memory or external data) into a torch tensor of the same dtype. Quantized
    weights (trtopt.QMatMul's): FP8 E4M3 as torch.float8_e4m3fn, INT4/UINT4 unpacked to one int8/uint8 per value."""
    if tensor.dtype in _UNPACKED_DTYPES:
        return torch.from_numpy(np.array(tensor.numpy(), copy=True).astype(_UNPACKED_DTYPES[tensor.dtype]))
    if tensor.dtype == ir.DataType.FLOAT8E4M3FN:
        array = np.array(tensor.numpy(), copy=True, order="C")
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    dtype = ONNX_TO_TORCH_DTYPE.get(int(tensor.dtype))
    if dtype is None:
        raise UnsupportedOpError(
            f"tensor {tensor.name!r} has dtype {tensor.dtype.name}, which the torch executor cannot hold; "
            "run this plan with --backend onnxruntime."
        )
    array = np.array(tensor.numpy(), copy=True, order="C")  # (not ascontiguousarray: it makes 0-d arrays 1-d)
    if dtype == torch.bfloat16:
        # numpy holds bf16 as ml_dtypes.bfloat16, which torch cannot read: reinterpret the bits.
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


@functools.cache
def _accepted_kwargs(fn: Any) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins such as torch.eq take no attributes
        return frozenset()
    return frozenset(p.name for p in params if p.kind == p.KEYWORD_ONLY and not p.name.startswith("_"))


def _sanitize(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "v"
    if base[0].isdigit():
        base = "_" + base
    candidate, i = base, 1
    while candidate in taken:
        candidate, i = f"{base}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _is_absent_marker(value: ir.Value | None, converted: _Value) -> bool:
    """A zero initializer that attach_functions wires in for an absent optional input of a trtopt op (the bodies
    need a tensor; the torch ops take None, which skips the work: no ALiBi, no bias)."""
    return (value is not None and value.name is not None and value.name.startswith(ZERO_INPUT_PREFIX)
            and isinstance(converted, _Const) and not bool(converted.tensor.any()))


def _arg_key(arg: Any) -> Any:
    """A hashable identity for CSE: fx nodes by identity, Python values by type and value."""
    if isinstance(arg, list):
        return ("list", tuple(arg))
    if isinstance(arg, torch.fx.Node) or arg is None:
        return arg
    return (type(arg).__name__, arg)


def to_device(x: torch.Tensor, device: str) -> torch.Tensor:
    """A host value read as data by a device op."""
    return x.to(device, non_blocking=True)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A device value that shape arithmetic needs (a data-dependent shape: this one syncs)."""
    return x.cpu()


def shape_like_values(graph: ir.Graph) -> set[ir.Value]:
    """Values that only feed shapes: read as a shape-like input (Reshape's shape...), or computed by a standard
    op whose every output is such a value. They are computed on the host."""
    wanted: set[ir.Value] = set()
    for node in reversed(list(graph)):
        spec = STANDARD_OPS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if spec is None:
            continue
        for i in spec.list_inputs:
            if i < len(node.inputs) and node.inputs[i] is not None:
                wanted.add(node.inputs[i])
        if not spec.host_output and node.outputs and all(o in wanted for o in node.outputs):
            wanted.update(v for v in node.inputs if v is not None)
    return wanted


# The module attribute that holds the PagedLaunchState its PagedAttention calls are given.
PAGED_STATE_ATTR = "paged_state"


class _Converter:
    def __init__(self, model: ir.Model, *, device: torch.device, body_ops: Collection[str],
                 paged_state: PagedLaunchState | None = None, reference_ops: Collection[str] = ()):
        self.model = model
        self.device = device
        self.paged_state = paged_state
        self.paged_state_node: torch.fx.Node | None = None  # the get_attr of it, made at the first PagedAttention
        self.split = device.type != "cpu"  # host and device differ: track where each value lives
        self.body_ops = frozenset(body_ops)  # trtopt op types to run from their function body
        self.reference_ops = frozenset(reference_ops)  # trtopt op types to run through their torch reference
        if unknown := self.reference_ops - set(REFERENCE_OPS):
            raise ValueError(f"reference_ops {sorted(unknown)}: only {sorted(REFERENCE_OPS)} have a reference path")
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.names: set[str] = set()
        self.const_nodes: dict[tuple[int, bool], torch.fx.Node] = {}  # (id(tensor), on host) → get_attr node
        self.host: set[torch.fx.Node] = set()  # nodes whose value is a host tensor (only when split)
        self.transfers: dict[torch.fx.Node, torch.fx.Node] = {}  # host node → its copy on the device
        self.host_consts: dict[str, torch.Tensor] = {}  # constants read on the host, by attribute name
        self.to_host_nodes: dict[torch.fx.Node, torch.fx.Node] = {}  # device node → its host copy
        self.shape_like = shape_like_values(model.graph) if self.split else set()
        self.cse: dict[Any, torch.fx.Node] = {}
        self.functions = {(f.domain, f.name, f.overload): f for f in model.functions.values()}

    # -- values ------------------------------------------------------------------------------------------------------
    def materialize(self, value: _Value, *, on_host: bool = False) -> torch.fx.Node | None:
        """An fx node for a value; a constant becomes a buffer of the root module (once per tensor and place).

        Host constants end up as plain CPU attributes, not buffers, so moving the module leaves them alone.
        """
        if not isinstance(value, _Const):
            return value
        key = (id(value.tensor), on_host)
        if key not in self.const_nodes:
            name = _sanitize(f"c_{len(self.const_nodes)}", self.names)
            if on_host:
                self.host_consts[name] = value.tensor
                self.root.register_buffer(name, value.tensor)  # re-attached as a plain attribute in convert()
                self.const_nodes[key] = self.graph.get_attr(name)
                self.host.add(self.const_nodes[key])
            else:
                self.root.register_buffer(name, value.tensor)
                self.const_nodes[key] = self.graph.get_attr(name)
        return self.const_nodes[key]

    def call_arg(self, value: _Value, position: int, spec: OpSpec, *, folding: bool = False,
                 on_host: bool = False) -> Any:
        """How input `position` is passed: a Python list/number when constant and the op allows it; else a node
        (or, when folding at conversion time, the constant tensor itself). A device op reading a host value as
        data gets the value's device copy."""
        if isinstance(value, _Const):
            if position in spec.list_inputs:
                return as_ints(value.tensor)
            if position in spec.scalar_inputs and value.tensor.dim() == 0:
                return value.tensor.item()
            if folding:
                return value.tensor
            return self.materialize(value, on_host=on_host)
        if value is None or not self.split or position in spec.list_inputs:
            return value
        if not on_host and value in self.host:
            if value not in self.transfers:
                self.transfers[value] = self.graph.call_function(to_device, (value, str(self.device)))
            return self.transfers[value]
        if on_host and value not in self.host and not spec.host_output:
            if value not in self.to_host_nodes:
                self.to_host_nodes[value] = self.graph.call_function(to_host, (value,))
            return self.to_host_nodes[value]
        return value

    def runs_on_host(self, spec: OpSpec, inputs: list[_Value], standard: bool, shape_like: bool) -> bool:
        """Shape/Size always; another standard op when every runtime input is already on the host, or when all
        it computes is shape-like (e.g. a legacy export's ConstantOfShape → Where chain building Expand's shape)."""
        if not self.split:
            return False
        if spec.host_output:
            return True
        if not standard:
            return False
        runtime = [v for v in inputs if isinstance(v, torch.fx.Node)]
        return shape_like or (not spec.wants_device and all(v in self.host for v in runtime))

    # -- attributes --------------------------------------------------------------------------------------------------
    @staticmethod
    def resolve_attrs(node: ir.Node, scope: dict[str, ir.Attr] | None) -> dict[str, ir.Attr]:
        """The node's attributes, with references to the enclosing function's attributes replaced by values."""
        attrs = {}
        for name, attr in node.attributes.items():
            if attr.is_ref():
                if scope is not None and attr.ref_attr_name in scope:
                    attrs[name] = scope[attr.ref_attr_name]
                continue  # an unset reference leaves the attribute at its default
            attrs[name] = attr
        return attrs

    def kwargs_for(self, node: ir.Node, spec: OpSpec, attrs: dict[str, ir.Attr], opset: int) -> dict:
        op = f"{node.domain or 'ai.onnx'}::{node.op_type}"
        accepted = _accepted_kwargs(spec.fn)
        kwargs: dict[str, Any] = {}
        for name, attr in attrs.items():
            if name in _IGNORED_ATTRS:
                continue
            if name not in accepted:
                raise UnsupportedOpError(
                    f"node {node.name!r} ({op}, opset {opset}) has attribute {name!r}, which the torch converter "
                    "does not implement; run this plan with --backend onnxruntime."
                )
            kwargs[name] = self.attr_value(node, op, attr)
        if node.op_type == "Cast":
            kwargs["to"] = self.dtype_of(node, kwargs["to"])
        if node.op_type == "ConstantOfShape" and "value" in kwargs:
            fill = kwargs.pop("value")
            kwargs["value"], kwargs["dtype"] = fill.reshape(-1)[0].item(), fill.dtype
        if spec.wants_num_outputs:
            kwargs["_n"] = len(node.outputs)
        return kwargs

    def attr_value(self, node: ir.Node, op: str, attr: ir.Attr) -> Any:
        kind = attr.type
        if kind in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
            return list(attr.value)
        if kind == ir.AttributeType.TENSOR:
            return ir_tensor_to_torch(attr.value)
        if kind in (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING):
            return attr.value
        raise UnsupportedOpError(
            f"node {node.name!r} ({op}) has a {kind.name} attribute {attr.name!r} (subgraphs and control flow are "
            "not supported by the torch converter); run this plan with --backend onnxruntime."
        )

    @staticmethod
    def dtype_of(node: ir.Node, onnx_dtype: int) -> torch.dtype:
        if onnx_dtype not in ONNX_TO_TORCH_DTYPE:
            raise UnsupportedOpError(
                f"node {node.name!r} casts to ONNX dtype {onnx_dtype}, which the torch executor does not support."
            )
        return ONNX_TO_TORCH_DTYPE[onnx_dtype]

    # -- nodes -------------------------------------------------------------------------------------------------------
    def emit_graph(self, nodes, env: dict[ir.Value, _Value], opset: int, scope: dict[str, ir.Attr] | None) -> None:
        for node in nodes:
            outputs = self.emit_node(node, env, opset, scope)
            for out, value in zip(node.outputs, outputs):
                env[out] = value

    def emit_node(self, node: ir.Node, env, opset: int, scope) -> list[_Value]:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        op = node.op_type
        attrs = self.resolve_attrs(node, scope)
        inputs = [env[v] if v is not None else None for v in node.inputs]
        if domain == "" and op == "Constant":
            return [_Const(self.constant_value(node, attrs))]
        if domain == "" and op == "Shape":
            folded = self.fold_shape(node, attrs)
            if folded is not None:
                return [folded]
        spec = self.find_spec(domain, op)
        if spec is None:
            function = self.functions.get((node.domain, op, node.overload))
            if function is None:
                raise UnsupportedOpError(
                    f"node {node.name!r} uses op {domain or 'ai.onnx'}::{op} (opset "
                    f"{self.model.opset_imports.get(domain, opset)}), which the torch converter does not implement "
                    "and the model defines no function body for; run this plan with --backend onnxruntime, or add "
                    "the op to trtopt/runtime/executors/onnx_ops.py."
                )
            return self.inline_function(function, node, inputs, attrs)
        if domain == "" and opset < MIN_OPSET.get(op, 0):
            raise UnsupportedOpError(
                f"node {node.name!r}: {op} at opset {opset} has pre-opset-{MIN_OPSET[op]} semantics that the torch "
                "converter does not implement; re-export the model at opset >= 17."
            )
        if domain == "trtopt":
            inputs = [None if _is_absent_marker(v, value) else value for v, value in zip(node.inputs, inputs)]
        kwargs = self.kwargs_for(node, spec, attrs, opset)
        if domain == "trtopt" and op == "PagedAttention" and self.paged_state is not None:
            kwargs["state"] = self.state_node()
        pure = (domain, op) not in IMPURE_OPS
        shape_like = bool(node.outputs) and all(o in self.shape_like for o in node.outputs)
        return self.emit_call(spec, inputs, kwargs, len(node.outputs), pure, standard=domain == "",
                              shape_like=shape_like)

    def state_node(self) -> torch.fx.Node:
        """The module's PagedLaunchState as a graph value (one get_attr node, read by every PagedAttention call)."""
        if self.paged_state_node is None:
            self.names.add(PAGED_STATE_ATTR)
            setattr(self.root, PAGED_STATE_ATTR, self.paged_state)
            self.paged_state_node = self.graph.get_attr(PAGED_STATE_ATTR)
        return self.paged_state_node

    def find_spec(self, domain: str, op: str) -> OpSpec | None:
        if domain == "":
            return STANDARD_OPS.get(op)
        if domain == "trtopt":
            if op in self.body_ops:
                return None
            return REFERENCE_OPS[op] if op in self.reference_ops else TRTOPT_OPS.get(op)
        return _CONTRIB_OPS.get((domain, op))

    def emit_call(self, spec: OpSpec, inputs: list[_Value], kwargs: dict, num_outputs: int, pure: bool, *,
                  standard: bool, shape_like: bool = False):
        while inputs and inputs[-1] is None:  # trailing absent optional inputs take the function's defaults
            inputs.pop()
        if pure and all(isinstance(v, _Const) or v is None for v in inputs):
            args = [self.call_arg(v, i, spec, folding=True) for i, v in enumerate(inputs)]
            if spec.wants_device:
                kwargs = {**kwargs, "device": "cpu"}
            result = spec.fn(*args, **kwargs)
            results = list(result) if isinstance(result, (tuple, list)) else [result]
            return [_Const(r) for r in results]

        on_host = self.runs_on_host(spec, inputs, standard, shape_like)
        args = tuple(self.call_arg(v, i, spec, on_host=on_host) for i, v in enumerate(inputs))
        if spec.wants_device:
            kwargs = {**kwargs, "device": "cpu" if on_host else str(self.device)}
        key = (spec.fn, tuple(_arg_key(a) for a in args), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        call = self.cse.get(key) if pure else None
        if call is None:
            call = self.graph.call_function(spec.fn, args, kwargs)
            if pure:
                self.cse[key] = call
        outputs = [call] if num_outputs == 1 else [
            self.graph.call_function(operator.getitem, (call, i)) for i in range(num_outputs)]
        if on_host:
            self.host.update(outputs + [call])
        return outputs

    def constant_value(self, node: ir.Node, attrs: dict[str, ir.Attr]) -> torch.Tensor:
        (name, attr), = attrs.items()
        if name == "value":
            return ir_tensor_to_torch(attr.value)
        as_tensor = {
            "value_float": lambda v: torch.tensor(v, dtype=torch.float32),
            "value_floats": lambda v: torch.tensor(list(v), dtype=torch.float32),
            "value_int": lambda v: torch.tensor(v, dtype=torch.int64),
            "value_ints": lambda v: torch.tensor(list(v), dtype=torch.int64),
        }
        if name not in as_tensor:
            raise UnsupportedOpError(f"Constant node {node.name!r} uses {name!r}, which the torch converter cannot hold.")
        return as_tensor[name](attr.value)

    @staticmethod
    def fold_shape(node: ir.Node, attrs: dict[str, ir.Attr]) -> _Const | None:
        """Shape(x)[start:end] as a constant when those dims of x are static."""
        shape = node.inputs[0].shape
        if shape is None:
            return None
        start = attrs["start"].value if "start" in attrs else 0
        end = attrs["end"].value if "end" in attrs else None
        dims = list(shape.dims)[start:end]
        if not all(isinstance(d, int) for d in dims):
            return None
        return _Const(torch.tensor(dims, dtype=torch.int64))

    def inline_function(self, function: ir.Function, node: ir.Node, inputs: list[_Value], attrs) -> list[_Value]:
        """Emit the body of a model-local function in place of the call (ONNX function semantics)."""
        scope = {name: attr for name, attr in function.attributes.items() if attr.value is not None}
        scope.update(attrs)
        env: dict[ir.Value, _Value] = {}
        for i, formal in enumerate(function.inputs):
            env[formal] = inputs[i] if i < len(inputs) else None
        opset = function.opset_imports.get("", self.model.opset_imports.get("", 0))
        self.emit_graph(function, env, opset, scope)
        return [env[out] for out in function.outputs]

    # -- the whole graph ---------------------------------------------------------------------------------------------
    def convert(self) -> ConvertedGraph:
        graph = self.model.graph
        opset = self.model.opset_imports.get("", 0)
        if opset < 13:
            raise UnsupportedOpError(
                f"the model imports the ONNX default opset {opset}; the torch converter needs opset >= 13. "
                "Re-export the model at opset >= 17."
            )
        env: dict[ir.Value, _Value] = {}
        for value in graph.initializers.values():
            env[value] = _Const(ir_tensor_to_torch(value.const_value))
        input_names = []
        for value in graph.inputs:
            env[value] = self.graph.placeholder(_sanitize(value.name, self.names))
            input_names.append(value.name)
        self.emit_graph(graph, env, opset, None)
        outputs = tuple(self.materialize(env[v]) for v in graph.outputs)
        self.graph.output(outputs)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        module = torch.fx.GraphModule(self.root, self.graph, class_name="OnnxGraph").to(self.device)
        for name, tensor in self.host_consts.items():
            # GraphModule registers every tensor attribute as a buffer and .to() moved it; a plain attribute on
            # the CPU is what the host ops read (and later .to() calls leave it there).
            delattr(module, name)
            module.__dict__[name] = tensor
        return ConvertedGraph(module, input_names, [v.name for v in graph.outputs], opset)


def load_onnx(path: str | Path) -> ir.Model:
    """Load an ONNX model (and its external data, next to it) with onnx-ir."""
    path = Path(path)
    if not path.is_file():
        raise BuildError(f"{path} does not exist; point at the model.onnx of a plan or model dir.")
    try:
        return ir.load(path)
    except Exception as e:  # onnx-ir raises several types for corrupt files; all mean the same thing here
        raise BuildError(f"{path} is not a readable ONNX model ({e}); rebuild it with `trtopt build`.") from e


def onnx_to_torch(
    model: ir.Model | str | Path,
    *,
    device: torch.device | str = "cpu",
    body_ops: Collection[str] = (),
    paged_state: PagedLaunchState | None = None,
    reference_ops: Collection[str] = (),
) -> ConvertedGraph:
    """Convert an ONNX model into a torch.fx GraphModule on `device`.

    body_ops: trtopt op types to run from their ONNX function body instead of the torch implementation (tests use
    it to check the two agree). paged_state: what every PagedAttention call of the module is given
    (trtopt_ops.paged_launch_state; the caller owns it); None: each call makes its own. reference_ops: trtopt op types
    (of trtopt_ops.REFERENCE_OPS) to run through their torch reference on every device instead of the kernel. Raises
    UnsupportedOpError naming the op, domain, opset and node it cannot convert.
    """
    if not isinstance(model, ir.Model):
        model = load_onnx(model)
    return _Converter(model, device=torch.device(device), body_ops=body_ops, paged_state=paged_state,
                      reference_ops=reference_ops).convert()
