"""Prove what an exported attention mask means by evaluating it.

The mask-building subgraphs of the exporters differ wildly (GatherND over a bool cache position grid, sliced
causal buffers, Where(Expand(And(...)))...), so instead of pattern-matching them we cut out the subgraph that
computes the mask, run it on onnxruntime for a few (past, new) lengths with no padding (batch 1, attention_mask
all ones, which is what the paged runtime gives), and read off which key positions each query may see.

The mask is accepted only if every probed row is exactly a causal range [p − W + 1, p] with one W for all rows
(W = 0: no sliding window, as far as the probes reach). Any other value, e.g. an ALiBi bias that is not 0/−inf,
or a mask that differs per head, is refused, so the rewrite never changes what the graph computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from trtopt.fusion_passes.attention_match import MASKED, MaskSpec
from trtopt.fusion_passes.trace import NoMatch

# Initializers bigger than this may not be pulled into a probe. Legacy exports read the mask's shape and dtype off
# the token embeddings (Shape(Gather(embed_tokens, ids))), so the embedding table must be allowed.
_MAX_PROBE_INITIALIZER = 1 << 28


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """How to feed the graph inputs that a mask may read."""

    input_ids: str
    position_ids: str
    attention_mask: str | None
    past: tuple[ir.Value, ...]  # the past-key/value graph inputs: [B, Hkv, P, D]


@dataclasses.dataclass(frozen=True)
class CausalWindow:
    """The proven meaning of a mask: causal, with a sliding window of ``window`` tokens (0 = none seen)."""

    window: int


def _slice_nodes(graph: ir.Graph, target: ir.Value) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]]:
    """Nodes, graph inputs and initializers that ``target`` depends on, nodes in graph order."""
    needed: set[int] = set()
    inputs: dict[str, ir.Value] = {}
    initializers: dict[str, ir.Value] = {}
    stack = [target]
    seen_values: set[int] = set()
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen_values:
            continue
        seen_values.add(id(value))
        node = value.producer()
        if node is None:
            if value.is_graph_input():
                inputs[value.name] = value
            elif value.const_value is not None:
                initializers[value.name] = value
            continue
        if id(node) in needed:
            continue
        needed.add(id(node))
        stack.extend(node.inputs)
    nodes = [n for n in graph if id(n) in needed]
    return nodes, list(inputs.values()), list(initializers.values())


def _output_info(target: ir.Value) -> onnx.ValueInfoProto:
    if target.type is not None:
        return ir.serde.serialize_value(target)
    # Legacy exports carry no intermediate types; ORT accepts an output with an empty type.
    return onnx.helper.make_value_info(target.name, onnx.TypeProto())


def _probe_model(model: ir.Model, target: ir.Value) -> tuple[onnx.ModelProto, list[ir.Value]]:
    nodes, inputs, initializers = _slice_nodes(model.graph, target)
    for init in initializers:
        if init.const_value.nbytes > _MAX_PROBE_INITIALIZER:
            raise NoMatch(f"the mask reads the large initializer {init.name}; refusing to treat it as a mask")
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "mask_probe",
        [ir.serde.serialize_value(v) for v in inputs],
        [_output_info(target)],
        # Read external data into the probe (a model loaded from bytes cannot follow external-data paths).
        [ir.serde.serialize_tensor(ir.Tensor(v.const_value.numpy(), name=v.name)) for v in initializers],
    )
    for proto, init in zip(graph.initializer, initializers, strict=True):
        proto.name = init.name
    _bf16_to_float32(graph)
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version), inputs


_BF16 = onnx.TensorProto.BFLOAT16


def _float32_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    values = onnx.numpy_helper.to_array(tensor).astype(np.float32)
    return onnx.numpy_helper.from_array(values, tensor.name)


def _bf16_to_float32(graph: onnx.GraphProto) -> None:
    """Run a bf16 model's mask subgraph in float32: ORT's CPU provider has no bf16 kernels (Where, Mul...).

    Masks hold 0 and a large negative (or booleans), and positions are integers, so which keys each query may see
    is the same in float32; only the probe is changed, never the model.
    """
    for info in [*graph.input, *graph.output]:
        if info.type.tensor_type.elem_type == _BF16:
            info.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    for i, init in enumerate(graph.initializer):
        if init.data_type == _BF16:
            graph.initializer[i].CopyFrom(_float32_tensor(init))
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == _BF16:
                attr.i = onnx.TensorProto.FLOAT
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == _BF16:
                attr.t.CopyFrom(_float32_tensor(attr.t))


def _feeds(inputs: list[ir.Value], roles: ProbeInputs, past_len: int, new_len: int) -> dict[str, np.ndarray]:
    past_by_name = {v.name: v for v in roles.past}
    feeds = {}
    for value in inputs:
        # bf16 inputs are declared float32 in the probe (see _bf16_to_float32).
        dtype = np.float32 if value.dtype == ir.DataType.BFLOAT16 else ir.DataType(value.dtype).numpy()
        if value.name == roles.input_ids:
            feeds[value.name] = np.zeros((1, new_len), dtype=dtype)
        elif value.name == roles.position_ids:
            feeds[value.name] = np.arange(past_len, past_len + new_len, dtype=dtype)[None]
        elif value.name == roles.attention_mask:
            feeds[value.name] = np.ones((1, past_len + new_len), dtype=dtype)
        elif value.name in past_by_name:
            _, heads, _, head_dim = (d if isinstance(d, int) else 1 for d in value.shape)
            feeds[value.name] = np.zeros((1, heads, past_len, head_dim), dtype=dtype)
        else:
            raise NoMatch(f"the mask depends on the graph input {value.name}, which the probe cannot feed")
    return feeds


def _allowed(mask: MaskSpec, value: np.ndarray, new_len: int, total: int) -> np.ndarray:
    """Boolean [new_len, keys]: which keys each query may see, from the evaluated mask.

    keys is the mask's last dim: ``total`` (= past + new), or fewer when the graph trims the past before the
    Concat (a sliding-window cache); the kept keys are then the last ones.
    """
    keys = value.shape[-1] if value.ndim and value.shape[-1] != 1 else total
    if keys > total:
        raise NoMatch(f"the mask has {keys} key columns for {total} keys")
    full = np.broadcast_to(value, value.shape[:-2] + (new_len, keys)).reshape(-1, new_len, keys)
    if not (full == full[:1]).all():
        raise NoMatch("the mask differs across batch/heads (an ALiBi-like or per-head bias)")
    rows = full[0]
    if mask.kind == "add":
        keep = rows == 0.0
        if not (keep | (rows <= MASKED)).all():
            raise NoMatch("the additive mask has values other than 0 and a large negative (an ALiBi-like bias)")
        return keep
    as_bool = rows.astype(bool)
    return as_bool if mask.kind == "where_keep" else ~as_bool


def _window_of(allowed: np.ndarray, past_len: int) -> int | None:
    """The W such that row j sees exactly [p − W + 1, p] for p = past_len + j; None for an unbounded window.

    Column c of ``allowed`` is key position c + (past_len + rows − columns): the columns are the last keys.
    """
    window: int | None = None
    new_len, keys = allowed.shape
    first_key = past_len + new_len - keys
    for j, row in enumerate(allowed):
        p = past_len + j
        seen = np.flatnonzero(row) + first_key
        if seen.size == 0 or seen[-1] != p or seen.size != seen[-1] - seen[0] + 1:
            raise NoMatch(f"the mask is not causal: query at position {p} sees keys {seen.tolist()[:8]}...")
        if seen[0] > 0:
            w = p - int(seen[0]) + 1
            if window is not None and w != window:
                raise NoMatch(f"the mask's window changes between rows ({window} vs {w})")
            window = w
    return window


def probe_causal(model: ir.Model, mask: MaskSpec, roles: ProbeInputs, *, long_len: int = 512) -> CausalWindow:
    """Evaluate ``mask`` for several lengths; return its causal window or raise NoMatch."""
    import onnxruntime as ort

    proto, inputs = _probe_model(model, mask.value)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types; any failure means "cannot prove"
        raise NoMatch(f"the mask subgraph does not run on its own ({type(e).__name__}: {str(e)[:200]})") from e
    window: int | None = None
    probes = [(0, 4), (3, 1), (5, 3), (max(long_len - 3, 0), 3)]
    for past_len, new_len in probes:
        try:
            (value,) = session.run([mask.value.name], _feeds(inputs, roles, past_len, new_len))
        except NoMatch:
            raise
        except Exception as e:
            raise NoMatch(
                f"the mask subgraph failed for past={past_len}, new={new_len} ({type(e).__name__}: {str(e)[:160]})"
            ) from e
        rows_window = _window_of(_allowed(mask, np.asarray(value), new_len, past_len + new_len), past_len)
        if rows_window is not None:
            if window is not None and window != rows_window:
                raise NoMatch(f"the mask's window differs between probes ({window} vs {rows_window})")
            window = rows_window
        elif window is not None and past_len + new_len > window:
            raise NoMatch("the mask is windowed for some lengths and not for others")
    return CausalWindow(window or 0)
