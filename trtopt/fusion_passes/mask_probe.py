"""Prove what an exported attention mask means by evaluating it.

The mask-building subgraphs of the exporters differ wildly (GatherND over a bool cache position grid, sliced
causal buffers, Where(Expand(And(...)))...), so instead of pattern-matching them we cut out the subgraph that
computes the mask, run it on onnxruntime for a few (past, new) lengths with no padding (batch 1, attention_mask
all ones, which is what the paged runtime gives), and read off which key positions each query may see.

The mask is accepted only if every probed row is exactly a causal range [p − W + 1, p] with one W for all rows
(W = 0: no sliding window, as far as the probes reach), the same for every head. The finite values on the visible
keys (an additive mask that is not just 0, plus BLOOM's separate folded bias) must be an ALiBi bias: for every
probe, head h and query at position p, bias[h, p, k] − bias[h, p, p] = slope[h]·(k − p) for each visible key k.
Softmax cancels a per-row constant, so this is exactly the op's ``slope[h]·(kpos − p)`` whether the graph adds
slope·kpos (BLOOM, kpos from the attention-mask cumsum) or slope·(kpos − p). The slopes are read off the longest
probed row and checked on every other row to 1e-6 relative to the row's largest |bias| (float32 rounding of
slope·kpos). Anything else, e.g. a bias not linear in the key position or a mask that differs per head, is
refused, so the rewrite never changes what the graph computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from trtopt.fusion_passes.attention_match import MASKED, MaskSpec
from trtopt.fusion_passes.trace import NoMatch

# Initializers bigger than this may not be pulled into a probe (their contents would have to be copied into it).
# Tables that a probe reads only through Shape (legacy exports take the mask's shape and dtype off the token
# embeddings, Shape(Gather(embed_tokens, ids)·c)) are never pulled in whole: see _shape_only_tables.
_MAX_PROBE_INITIALIZER = 1 << 28
# Ops whose output *shape* depends only on their inputs' shapes (not on any input's contents). Walking back from a
# Shape node through these, every input is read for its shape only.
_SHAPE_FROM_SHAPES = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Sqrt", "Cast", "CastLike", "Identity", "Relu", "Sigmoid",
    "Tanh", "Erf", "Exp", "Log", "Gather", "Equal", "Less", "Greater", "Not", "And", "Or", "Where",
})


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """How to feed the graph inputs that a mask may read."""

    input_ids: str
    position_ids: str
    attention_mask: str | None
    past: tuple[ir.Value, ...]  # the past-key/value graph inputs: [B, Hkv, P, D]


@dataclasses.dataclass(frozen=True)
class CausalWindow:
    """The proven meaning of a mask: causal, with a sliding window of ``window`` tokens (0 = none seen), plus an
    ALiBi bias slope[h]·(kpos − p) (None: no bias; one slope when the bias is the same for every head)."""

    window: int
    alibi_slopes: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _Probed:
    """One evaluated probe: which keys each query sees and the finite bias on them."""

    past_len: int
    allowed: np.ndarray  # bool [new, keys], the same for every head
    bias: np.ndarray  # float64 [heads or 1, new, keys], 0 where not allowed


def slice_nodes(graph: ir.Graph, targets: list[ir.Value]) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]]:
    """Nodes, graph inputs and initializers that ``targets`` depend on, nodes in graph order."""
    needed: set[int] = set()
    inputs: dict[str, ir.Value] = {}
    initializers: dict[str, ir.Value] = {}
    stack = list(targets)
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


def content_read(nodes: list[ir.Node], targets: list[ir.Value]) -> set[int]:
    """ids of the values in the slice whose *contents* the targets depend on; the others are read only for their
    shape (they reach the targets only through Shape, possibly via ops of _SHAPE_FROM_SHAPES)."""
    content = {id(t) for t in targets}
    for node in reversed(nodes):  # graph order reversed: every consumer is seen before its producer
        if node.op_type == "Shape":
            continue
        if node.op_type in _SHAPE_FROM_SHAPES and not any(id(out) in content for out in node.outputs):
            continue  # only its shape is read, and that depends only on its inputs' shapes
        content.update(id(v) for v in node.inputs if v is not None)  # e.g. Reshape: its shape input's contents
    return content


def _shape_only_tables(nodes: list[ir.Node], targets: list[ir.Value], initializers: list[ir.Value]) -> set[int]:
    """Initializers that the probe reads only for their shape, and only as the data of Gather(axis=0): such a table
    can stand in as one zero row, [1, *rest], since Gather's output shape does not depend on the rows it has (the
    probe feeds token id 0; a Gather that indexes further fails the probe, which then proves nothing)."""
    content = content_read(nodes, targets)
    in_slice = {id(n) for n in nodes}
    tables = set()
    for init in initializers:
        uses = [u for u in init.uses() if id(u.node) in in_slice]
        if id(init) not in content and uses and all(
            u.node.op_type == "Gather" and u.idx == 0 and _axis(u.node) == 0 for u in uses
        ):
            tables.add(id(init))
    return tables


def _axis(node: ir.Node) -> int:
    attr = node.attributes.get("axis")
    return attr.value if attr is not None else 0


def _probe_tensor(init: ir.Value, shape_only: bool) -> onnx.TensorProto:
    """The initializer as the probe holds it: its contents, or one zero row when only its shape is read."""
    if shape_only:
        rest = tuple(init.const_value.shape)[1:]
        array = np.zeros((1, *rest), dtype=init.const_value.dtype.numpy())
    else:
        array = init.const_value.numpy()  # reads external data too (a model from bytes cannot follow its paths)
    return ir.serde.serialize_tensor(ir.Tensor(array, name=init.name))


def _output_info(target: ir.Value) -> onnx.ValueInfoProto:
    if target.type is not None:
        return ir.serde.serialize_value(target)
    # Legacy exports carry no intermediate types; ORT accepts an output with an empty type.
    return onnx.helper.make_value_info(target.name, onnx.TypeProto())


def _probe_model(model: ir.Model, targets: list[ir.Value]) -> tuple[onnx.ModelProto, list[ir.Value]]:
    nodes, inputs, initializers = slice_nodes(model.graph, targets)
    shape_only = _shape_only_tables(nodes, targets, initializers)
    for init in initializers:
        if id(init) not in shape_only and init.const_value.nbytes > _MAX_PROBE_INITIALIZER:
            raise NoMatch(f"the mask reads the contents of the large initializer {init.name}; refusing to treat "
                          "it as a mask")
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "mask_probe",
        [ir.serde.serialize_value(v) for v in inputs],
        [_output_info(t) for t in targets],
        [_probe_tensor(v, id(v) in shape_only) for v in initializers],
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


def _per_head(value: np.ndarray, new_len: int, keys: int) -> np.ndarray:
    """[heads or 1, new_len, keys] view of an evaluated mask/bias (batch is 1 in the probe)."""
    return np.broadcast_to(value, value.shape[:-2] + (new_len, keys)).reshape(-1, new_len, keys)


def _split(mask: MaskSpec, values: list[np.ndarray], new_len: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, bias): bool [new_len, keys], which keys each query may see, the same for every head; and the
    float64 bias [heads or 1, new_len, keys] added on the visible keys (0 elsewhere).

    keys is the mask's last dim: ``total`` (= past + new), or fewer when the graph trims the past before the
    Concat (a sliding-window cache); the kept keys are then the last ones.
    """
    value = values[0]
    keys = value.shape[-1] if value.ndim and value.shape[-1] != 1 else total
    if keys > total:
        raise NoMatch(f"the mask has {keys} key columns for {total} keys")
    full = _per_head(value, new_len, keys)
    if mask.kind == "add":
        if np.isnan(full).any():
            raise NoMatch("the additive mask holds NaN")
        keep = full > MASKED
        bias = np.where(keep, full, 0.0).astype(np.float64)
    else:
        as_bool = full.astype(bool)
        keep = as_bool if mask.kind == "where_keep" else ~as_bool
        bias = np.zeros((1, new_len, keys))
    if not (keep == keep[:1]).all():
        raise NoMatch("the mask differs across batch/heads (a per-head mask)")
    allowed = keep[0]
    if mask.folded_bias is not None:
        folded = values[1]
        heads = folded.shape[0] if folded.ndim == 3 else 0
        if folded.shape[1:] not in ((1, keys), (new_len, keys)) or bias.shape[0] not in (1, heads):
            raise NoMatch(f"the folded bias has shape {list(folded.shape)}, not [heads, 1 | {new_len}, {keys}]")
        bias = bias + np.where(allowed, _per_head(folded, new_len, keys), 0.0)
    if not np.isfinite(bias).all():
        raise NoMatch("the bias on visible keys is not finite")
    return allowed, bias


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


def _seen(probe: _Probed, row: int) -> np.ndarray:
    return np.flatnonzero(probe.allowed[row])


def _alibi_slopes(probes: list[_Probed]) -> tuple[float, ...] | None:
    """slope[h] with bias[h, p, k] − bias[h, p, p] = slope[h]·(k − p) on every visible key of every probe, None
    when the bias is 0 everywhere, NoMatch when it is not of that form."""
    heads = {p.bias.shape[0] for p in probes}
    count = max(heads)
    if heads - {1, count}:
        raise NoMatch(f"the bias has {sorted(heads)} heads across probes")
    # The longest visible row gives the most precise slope (the span divides the rounding error).
    probe, row = max(((p, j) for p in probes for j in range(p.allowed.shape[0])), key=lambda pj: _seen(*pj).size)
    cols = _seen(probe, row)
    if cols.size < 2:
        return None  # one visible key per query: any bias is cancelled by softmax
    bias = np.broadcast_to(probe.bias, (count,) + probe.bias.shape[1:])
    slopes = (bias[:, row, cols[-1]] - bias[:, row, cols[0]]) / float(cols[-1] - cols[0])
    slopes = slopes.astype(np.float32).astype(np.float64)
    for p in probes:
        b = np.broadcast_to(p.bias, (count,) + p.bias.shape[1:])
        for j in range(p.allowed.shape[0]):
            cols = _seen(p, j)
            diag = cols[-1]  # the query's own position (causal proven)
            expected = b[:, j, diag : diag + 1] + slopes[:, None] * (cols - diag)[None, :]
            actual = b[:, j, cols]
            tolerance = 1e-6 * max(1.0, float(np.abs(actual).max()))
            if np.abs(actual - expected).max() > tolerance:
                worst = int(np.abs(actual - expected).max(axis=1).argmax())
                raise NoMatch(
                    f"the bias is not linear in the key position (not ALiBi): head {worst}, query at position "
                    f"{p.past_len + j}, past={p.past_len}; off by {np.abs(actual - expected).max():.3g}"
                )
    if not slopes.any():
        return None
    return tuple(float(x) for x in slopes)


def evaluate_feeds(
    model: ir.Model, targets: list[ir.Value], feeds: list[dict[str, np.ndarray]]
) -> list[list[np.ndarray]]:
    """Run the subgraph computing ``targets`` on ORT once per feed dict (keyed by graph input name; inputs the
    subgraph does not read are dropped). bf16 is computed in float32, as for the mask probes (``_bf16_to_float32``:
    the caller decides whether that is exact for its values). NoMatch when it cannot be cut out or run."""
    import onnxruntime as ort

    proto, inputs = _probe_model(model, targets)
    names = [v.name for v in inputs]
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return [[np.asarray(v) for v in session.run([t.name for t in targets], {n: f[n] for n in names})]
                for f in feeds]
    except Exception as e:  # ORT raises its own exception types; any failure means "cannot prove"
        raise NoMatch(f"the subgraph of {targets[0].name} does not run on its own ({type(e).__name__})") from e


def evaluate_at(
    model: ir.Model, targets: list[ir.Value], roles: ProbeInputs, lengths: list[tuple[int, int]]
) -> list[list[np.ndarray]]:
    """Run the subgraph computing ``targets`` on ORT for each (past, new) length, fed as the paged runtime implies
    (batch 1, attention_mask all ones); NoMatch when it cannot be cut out, fed or run."""
    import onnxruntime as ort

    proto, inputs = _probe_model(model, targets)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return [
            [np.asarray(v) for v in session.run([t.name for t in targets], _feeds(inputs, roles, past, new))]
            for past, new in lengths
        ]
    except NoMatch:
        raise
    except Exception as e:  # ORT raises its own exception types; any failure means "cannot prove"
        raise NoMatch(f"the subgraph of {targets[0].name} does not run on its own ({type(e).__name__})") from e


def probe_causal(model: ir.Model, mask: MaskSpec, roles: ProbeInputs, *, long_len: int = 512) -> CausalWindow:
    """Evaluate ``mask`` (and its folded bias) for several lengths; return its causal window and ALiBi slopes or
    raise NoMatch."""
    import onnxruntime as ort

    targets = [mask.value] + ([mask.folded_bias] if mask.folded_bias is not None else [])
    proto, inputs = _probe_model(model, targets)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types; any failure means "cannot prove"
        raise NoMatch(f"the mask subgraph does not run on its own ({type(e).__name__}: {str(e)[:200]})") from e
    window: int | None = None
    probed: list[_Probed] = []
    probes = [(0, 4), (3, 1), (5, 3), (max(long_len - 3, 0), 3)]
    for past_len, new_len in probes:
        try:
            values = session.run([t.name for t in targets], _feeds(inputs, roles, past_len, new_len))
        except NoMatch:
            raise
        except Exception as e:
            raise NoMatch(
                f"the mask subgraph failed for past={past_len}, new={new_len} ({type(e).__name__}: {str(e)[:160]})"
            ) from e
        allowed, bias = _split(mask, [np.asarray(v) for v in values], new_len, past_len + new_len)
        rows_window = _window_of(allowed, past_len)
        probed.append(_Probed(past_len, allowed, bias))
        if rows_window is not None:
            if window is not None and window != rows_window:
                raise NoMatch(f"the mask's window differs between probes ({window} vs {rows_window})")
            window = rows_window
        elif window is not None and past_len + new_len > window:
            raise NoMatch("the mask is windowed for some lengths and not for others")
    return CausalWindow(window or 0, _alibi_slopes(probed))
