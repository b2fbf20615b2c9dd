"""Rule: attention with a KV cache → trtopt.PagedAttention, and the paged signature of DESIGN.md §3.

A cache graph has, per layer, ``present = Concat(past, new, axis=2)`` for keys and values. Every attention that
reads such a pair is replaced by one PagedAttention node that takes the *new* k/v, writes them into the layer's
pool and attends over the pool. The rewrite is all-or-nothing: the paged signature drops every past/present
tensor, so if any cache-reading attention cannot be proven (see attention_match and mask_probe), the build stops
with a FusionError that lists why, and the graph is left as it was.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from trtopt.errors import FusionError
from trtopt.fusion_passes.attention_match import (
    AttentionMatch,
    int_list_constant,
    is_attention_anchor,
    match_attention,
)
from trtopt.fusion_passes.context import PassContext
from trtopt.fusion_passes.attention_match import MaskSpec
from trtopt.fusion_passes.mask_probe import CausalWindow, ProbeInputs, probe_causal
from trtopt.fusion_passes.shape_rebind import rebind_cache_shapes
from trtopt.fusion_passes.trace import NoMatch
from trtopt.fusion_passes.ops import cast_like_original, declare_domain, trtopt_node

RULE = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One proven attention of a cache graph, ready to rewrite."""

    match: AttentionMatch
    past_key: ir.Value  # graph input [B, Hkv, P, D]
    past_value: ir.Value
    present_key: ir.Value  # Concat output, a graph output
    present_value: ir.Value
    full_key: ir.Value  # the Concat outputs: [B, Hkv, P + T, D] (present may be a trimmed slice of them)
    full_value: ir.Value
    k_new: ir.Value  # [B, Hkv, T, D]
    v_new: ir.Value
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    alibi_slopes: tuple[float, ...] | None  # one per query head; None: no ALiBi


def _past_of(value: ir.Value | None) -> ir.Value | None:
    """The past graph input behind a Concat's first operand: the input itself, or a Slice of it on the sequence
    axis (HF's sliding-window cache keeps only the last W − 1 entries before concatenating)."""
    if value is None:
        return None
    if value.is_graph_input():
        return value
    node = value.producer()
    if node is not None and node.op_type == "Slice" and node.inputs[0] is not None and node.inputs[0].is_graph_input():
        axes = int_list_constant(node.inputs[3]) if len(node.inputs) > 3 else None
        if axes in ([2], [-2]):
            return node.inputs[0]
    return None


def _present_of(concat: ir.Node) -> ir.Value | None:
    """The present graph output of a cache Concat: its output, or a sequence-axis Slice of it (sliding window)."""
    out = concat.outputs[0]
    if out.is_graph_output():
        return out
    for use in out.uses():
        node = use.node
        if node.op_type == "Slice" and use.idx == 0 and node.outputs[0].is_graph_output():
            axes = int_list_constant(node.inputs[3]) if len(node.inputs) > 3 else None
            if axes in ([2], [-2]):
                return node.outputs[0]
    return None


def cache_concats(graph: ir.Graph) -> list[ir.Node]:
    """Concat(past, new) nodes that produce a present output: the signature of a KV-cache graph."""
    return [
        node
        for node in graph
        if node.op_type == "Concat"
        and len(node.inputs) == 2
        and _past_of(node.inputs[0]) is not None
        and _present_of(node) is not None
    ]


def has_cache_io(graph: ir.Graph) -> bool:
    """A KV-cache graph: Concat(past, new) → present, or at least optimum-style past/present names.

    The names catch cache forms the rule does not support (e.g. a sliding-window cache that trims the past before
    the Concat), so such a graph fails loudly instead of being built as a cache-free plan.
    """
    if cache_concats(graph):
        return True
    has_past = any("past" in (v.name or "") for v in graph.inputs)
    has_present = any("present" in (v.name or "") for v in graph.outputs)
    return has_past and has_present


def _cache_pair(value: ir.Value, what: str) -> ir.Node:
    node = value.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2 or _past_of(node.inputs[0]) is None:
        raise NoMatch(f"{what} do not come from Concat(past input, new)", node.name if node else "")
    if _present_of(node) is None:
        raise NoMatch(f"{what}: the Concat(past, new) does not produce a present output", node.name or "")
    axis = node.attributes["axis"].value
    if axis not in (2, -2):
        raise NoMatch(f"{what} are concatenated on axis {axis}, not the sequence axis 2", node.name or "")
    return node


def _static_dim(value: ir.Value, axis: int) -> int | None:
    if value.shape is None or len(value.shape) != 4:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def _head_dims(match: AttentionMatch, past_key: ir.Value, ctx: PassContext) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim): from the past input's shape where static, else config.json."""
    hkv = _static_dim(past_key, 1) or ctx.dims.num_kv_heads
    head_dim = _static_dim(past_key, 3) or ctx.dims.head_dim
    num_heads = _static_dim(match.q, 1) or ctx.dims.num_heads
    if num_heads is None and not match.repeat_kv:
        num_heads = hkv
    if hkv is None or head_dim is None or num_heads is None:
        raise NoMatch("cannot tell the head counts from the graph; put the model's config.json next to it")
    if ctx.dims.num_kv_heads is not None and ctx.dims.num_kv_heads != hkv:
        raise NoMatch(f"past input has {hkv} kv heads but config.json says {ctx.dims.num_kv_heads}")
    if not match.heads_consistent(num_heads, hkv):
        raise NoMatch(f"{num_heads} query heads and {hkv} kv heads do not match the graph's repeat_kv")
    return num_heads, hkv, head_dim


def _roles(graph: ir.Graph, pasts: list[ir.Value]) -> ProbeInputs:
    names = {v.name for v in graph.inputs}
    for required in ("input_ids", "position_ids"):
        if required not in names:
            raise FusionError(
                f"the cache graph has no `{required}` input; the paged signature needs it. "
                "Re-export with optimum-style inputs (input_ids, attention_mask, position_ids, past_key_values.*)."
            )
    mask = "attention_mask" if "attention_mask" in names else None
    return ProbeInputs("input_ids", "position_ids", mask, tuple(pasts))


def _probe_once(
    model: ir.Model,
    mask: MaskSpec,
    roles: ProbeInputs,
    ctx: PassContext,
    proven: dict[tuple[int, str, int], CausalWindow | NoMatch],
) -> CausalWindow:
    """The mask's window and ALiBi slopes; every layer usually shares one mask value, so each is probed once."""
    key = (id(mask.value), mask.kind, id(mask.folded_bias))
    if key not in proven:
        try:
            proven[key] = probe_causal(model, mask, roles, long_len=ctx.probe_len)
        except NoMatch as e:
            proven[key] = e
    result = proven[key]
    if isinstance(result, NoMatch):
        raise result
    return result


def _slopes_per_head(slopes: tuple[float, ...] | None, num_heads: int) -> tuple[float, ...] | None:
    """The proven slopes for each query head: a bias shared by all heads gives one slope."""
    if slopes is None:
        return None
    if len(slopes) == 1:
        return slopes * num_heads
    if len(slopes) != num_heads:
        raise NoMatch(f"the ALiBi bias has {len(slopes)} heads for {num_heads} query heads")
    return slopes


def _prove_layer(
    model: ir.Model,
    softmax: ir.Node,
    roles: ProbeInputs,
    ctx: PassContext,
    proven: dict[tuple[int, str, int], CausalWindow | NoMatch],
) -> PagedLayer:
    match = match_attention(softmax)
    if not match.k_heads_second:
        raise NoMatch("keys are cached in [B, S, H, D] layout", softmax.name or "")
    k_cat = _cache_pair(match.k, "keys")
    v_cat = _cache_pair(match.v, "values")
    if match.mask is None:
        raise NoMatch("no mask before Softmax, so the attention is not causal over the cache", softmax.name or "")
    meaning = _probe_once(model, match.mask, roles, ctx, proven)
    num_heads, hkv, head_dim = _head_dims(match, _past_of(k_cat.inputs[0]), ctx)
    slopes = _slopes_per_head(meaning.alibi_slopes, num_heads)
    return PagedLayer(
        match=match,
        past_key=_past_of(k_cat.inputs[0]),
        past_value=_past_of(v_cat.inputs[0]),
        present_key=_present_of(k_cat),
        present_value=_present_of(v_cat),
        full_key=k_cat.outputs[0],
        full_value=v_cat.outputs[0],
        k_new=k_cat.inputs[1],
        v_new=v_cat.inputs[1],
        num_heads=num_heads,
        num_kv_heads=hkv,
        head_dim=head_dim,
        window=meaning.window,
        alibi_slopes=slopes,
    )


def _layer_index(layer: PagedLayer, graph: ir.Graph) -> tuple[int, int]:
    found = re.search(r"\.(\d+)\.", layer.past_key.name or "")
    position = list(graph.inputs).index(layer.past_key)
    return (int(found.group(1)) if found else position, position)


def _new_input(name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))


@dataclasses.dataclass(frozen=True)
class StepTensors:
    """The per-step graph inputs shared by every layer (§3)."""

    block_tables: ir.Value
    seq_lens: ir.Value
    query_start_loc: ir.Value
    slot_mapping: ir.Value


def _step_tensors() -> StepTensors:
    return StepTensors(
        block_tables=_new_input("block_tables", ir.DataType.INT32, ["S", "max_blocks"]),
        seq_lens=_new_input("seq_lens", ir.DataType.INT32, ["S"]),
        query_start_loc=_new_input("query_start_loc", ir.DataType.INT32, ["S_plus_1"]),
        slot_mapping=_new_input("slot_mapping", ir.DataType.INT64, ["T"]),
    )


def _slopes_initializer(graph: ir.Graph, layer: PagedLayer, index: int) -> ir.Value | None:
    """The proven ALiBi slopes as the op's float32 [Hq] ``alibi_slopes`` input."""
    if layer.alibi_slopes is None:
        return None
    tensor = ir.tensor(np.array(layer.alibi_slopes, dtype=np.float32), name=f"alibi_slopes.{index}")
    value = ir.Value(name=tensor.name, const_value=tensor)
    value.shape, value.type = ir.Shape([layer.num_heads]), ir.TensorType(ir.DataType.FLOAT)
    graph.register_initializer(value)
    return value


def _paged_node(layer: PagedLayer, index: int, cache: ir.Value, step: StepTensors, slopes: ir.Value | None) -> ir.Node:
    m = layer.match
    attrs = [
        ir.AttrInt64("num_heads", layer.num_heads),
        ir.AttrInt64("num_kv_heads", layer.num_kv_heads),
        ir.AttrInt64("head_dim", layer.head_dim),
        ir.AttrFloat32("scale", m.scale),
        ir.AttrInt64("causal", 1),
        ir.AttrInt64("sliding_window", layer.window),
    ]
    inputs = [
        m.q,
        layer.k_new,
        layer.v_new,
        cache,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        step.slot_mapping,
        slopes,
    ]
    node = trtopt_node("PagedAttention", inputs, attrs, num_outputs=2, name=f"PagedAttention_{index}")
    out, cache_out = node.outputs
    out.name = f"paged_attention.{index}.out"
    out.shape = None if m.heads_folded else m.out.shape  # folded: [1, Hq, T, D], squeezed after
    out.type = ir.TensorType(m.q.dtype) if m.q.dtype is not None else m.out.type
    cache_out.name = f"kv_cache_out.{index}"
    cache_out.shape, cache_out.type = cache.shape, cache.type
    return node


def _insert_paged_nodes(
    graph: ir.Graph, layers: list[PagedLayer], block_size: int, step: StepTensors
) -> tuple[list[ir.Value], list[ir.Value]]:
    """One PagedAttention per layer, read by whatever read the old attention output; returns the pool I/O."""
    cache_inputs, cache_outputs = [], []
    for index, layer in enumerate(layers):
        dims = ["num_blocks", 2, layer.num_kv_heads, block_size, layer.head_dim]
        cache = _new_input(f"kv_cache.{index}", layer.past_key.dtype, dims)
        node = _paged_node(layer, index, cache, step, _slopes_initializer(graph, layer, index))
        graph.insert_after(layer.match.out_node, node)
        out, last = node.outputs[0], node
        if layer.match.heads_folded:
            # The graph continues from bmm's [B·Hq, T, D]; the op gives [1, Hq, T, D] (batch is 1 when paged).
            axes = _int64_initializer(graph, f"PagedAttention_{index}.squeeze_axes", [0])
            last = ir.Node("", "Squeeze", [out, axes], name=f"PagedAttention_{index}.unbatch")
            graph.insert_after(node, last)
            out = last.outputs[0]
            out.shape, out.type = layer.match.out.shape, node.outputs[0].type
        out = cast_like_original(graph, out, layer.match.out, last)
        ir.convenience.replace_all_uses_with(layer.match.out, out)
        cache_inputs.append(cache)
        cache_outputs.append(node.outputs[1])
    return cache_inputs, cache_outputs


def _int64_initializer(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))
    value.shape, value.type = ir.Shape([len(values)]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(value)
    return value


def _rebind_shapes(graph: ir.Graph, layers: list[PagedLayer]) -> None:
    """Re-source the size reads of every tensor the rewrite removes (see shape_rebind)."""
    cut: dict[int, int] = {}
    for layer in layers:
        for tensor in (
            layer.past_key,
            layer.past_value,
            layer.present_key,
            layer.present_value,
            layer.full_key,
            layer.full_value,
        ):
            cut[id(tensor)] = layer.num_kv_heads
        for tensor in (layer.match.k_repeated, layer.match.v_repeated):
            cut[id(tensor)] = layer.num_heads
        # (In the heads-folded form these are still the 4-D tensors before the fold; the 3-D folds stay dead
        # or are read only by the removed attention.)
    head_dims = {layer.head_dim for layer in layers}
    assert len(head_dims) == 1, f"layers disagree on head_dim: {head_dims}"
    input_ids = next(v for v in graph.inputs if v.name == "input_ids")
    rebind_cache_shapes(graph, cut, batch_source=input_ids, head_dim=head_dims.pop())


def _drop_cache_inputs(graph: ir.Graph, layers: list[PagedLayer]) -> list[ir.Value]:
    """Remove past inputs and attention_mask (dead by now); FusionError if something else still reads one."""
    pasts = {id(layer.past_key) for layer in layers} | {id(layer.past_value) for layer in layers}
    dropped = [v for v in graph.inputs if id(v) in pasts or v.name == "attention_mask"]
    for value in dropped:
        users = [use.node.name or use.node.op_type for use in value.uses()]
        if users:
            raise FusionError(
                f"`{value.name}` is still read by {users[:4]} outside attention, so the paged signature cannot drop "
                "it. Re-export with explicit position_ids (positions must not be derived from the mask or the past)."
            )
    dropped_ids = {id(v) for v in dropped}
    return [v for v in graph.inputs if id(v) not in dropped_ids]


def _rewrite(model: ir.Model, layers: list[PagedLayer], block_size: int) -> None:
    graph = model.graph
    step = _step_tensors()
    cache_inputs, cache_outputs = _insert_paged_nodes(graph, layers, block_size, step)
    _rebind_shapes(graph, layers)

    presents = {id(layer.present_key) for layer in layers} | {id(layer.present_value) for layer in layers}
    kept_outputs = [v for v in graph.outputs if id(v) not in presents]
    graph.outputs.clear()
    graph.outputs.extend(kept_outputs + cache_outputs)
    RemoveUnusedNodesPass()(model)

    by_name = {v.name: v for v in _drop_cache_inputs(graph, layers)}
    graph.inputs.clear()
    for name in ("input_ids", "position_ids"):
        by_name[name].shape = ir.Shape([1, "T"])
    ordered = [by_name.pop("input_ids"), by_name.pop("position_ids")]
    graph.inputs.extend(ordered + cache_inputs + list(by_name.values()))
    graph.inputs.extend([step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping])
    declare_domain(model)
    _forget_intermediate_shapes(graph)


def _forget_intermediate_shapes(graph: ir.Graph) -> None:
    """Drop the exporter's shapes of intermediate values: their symbols (batch, seq, past + seq) no longer mean
    what they said, and ORT plans buffer reuse from declared symbolic dims. Runtimes re-infer them."""
    for node in graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None


def _unread_pasts(layers: list[PagedLayer], model: ir.Model) -> list[str]:
    """Past inputs of cache Concats that no proven layer reads: the all-or-nothing rewrite must refuse then."""
    matched = {id(layer.past_key) for layer in layers} | {id(layer.past_value) for layer in layers}
    pasts = [_past_of(concat.inputs[0]) for concat in cache_concats(model.graph)]
    return [past.name for past in pasts if id(past) not in matched]


def fuse_paged_attention(model: ir.Model, ctx: PassContext, *, block_size: int) -> int:
    """Rewrite every cache attention to PagedAttention and the graph to the paged signature; return the count.

    Returns 0 for a graph without cache I/O. Raises FusionError when the graph has cache I/O but some of its
    attention could not be proven (the message lists the failed checks).
    """
    graph = model.graph
    if not has_cache_io(graph):
        return 0
    concats = cache_concats(graph)
    pasts = [_past_of(c.inputs[0]) for c in concats] or [v for v in graph.inputs if "past" in (v.name or "")]
    roles = _roles(graph, pasts)
    layers: list[PagedLayer] = []
    proven: dict[tuple[int, str, int], CausalWindow | NoMatch] = {}
    for softmax in [n for n in graph if is_attention_anchor(n)]:
        try:
            layers.append(_prove_layer(model, softmax, roles, ctx, proven))
        except NoMatch as e:
            ctx.trace.fail(RULE, softmax.name or "Softmax", e)
    unmatched = _unread_pasts(layers, model)
    if not layers or unmatched:
        reasons = "\n  ".join(ctx.trace.summary()) or "no Softmax found"
        what = (
            "no attention could be collapsed"
            if not layers
            else f"the cache inputs {unmatched[:4]} are not read by any fused attention"
        )
        raise FusionError(
            f"the graph has KV-cache inputs/outputs but {what}, so it cannot be rewritten to the paged signature.\n"
            f"  {reasons}\nExport the model with `trtopt export` (optimum-style I/O); "
            "docs/fusion.md lists the supported forms."
        )
    layers.sort(key=lambda layer: _layer_index(layer, graph))
    _rewrite(model, layers, block_size)
    return len(layers)
