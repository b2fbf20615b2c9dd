"""The proof half of the paged rewrite: find every attention of a KV-cache graph and prove what it computes.

A cache graph has, per layer, ``present = Concat(past, new, axis=2)`` for keys and values. Each attention that reads
such a pair is matched (attention_match) and its mask probed (mask_probe) into a ``PagedLayer``: the new k/v, the
head counts, the sliding window and ALiBi slopes. ``prove_layers`` is all-or-nothing: if any cache-reading
attention cannot be proven, it raises a FusionError listing why, and paged_attention rewrites nothing.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from trtopt import signature
from trtopt.errors import FusionError
from trtopt.fusion_passes.attention_match import AttentionMatch, MaskSpec, is_attention_anchor, match_attention
from trtopt.fusion_passes.context import PassContext
from trtopt.fusion_passes.ir_helpers import int_list_constant
from trtopt.fusion_passes.mask_probe import CausalWindow, ProbeInputs, probe_causal
from trtopt.fusion_passes.positions import derive_position_ids
from trtopt.fusion_passes.trace import NoMatch

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
    scale: float  # the whole attention scale (the match's constant part times its head-dim factors)
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


def _head_dims(
    match: AttentionMatch, past_key: ir.Value, past_value: ir.Value, ctx: PassContext
) -> tuple[int, int, int]:
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
    if _broadcast_single_kv_head(match, past_key, past_value, num_heads):
        return num_heads, 1, head_dim
    if not match.heads_consistent(num_heads, hkv):
        raise NoMatch(f"{num_heads} query heads and {hkv} kv heads do not match the graph's repeat_kv")
    return num_heads, hkv, head_dim


def _broadcast_single_kv_head(match: AttentionMatch, past_key: ir.Value, past_value: ir.Value, num_heads: int) -> bool:
    """Multi-query attention by broadcasting (Falcon-7B's form): no repeat_kv, and the cached keys and values have
    one head, which QKᵀ and probs·V broadcast over the query heads, so every query head reads kv head 0 (= h // Hq,
    the op's mapping). Proven from the past inputs' static head dim, never from config.json."""
    return (
        not match.repeat_kv
        and not match.native_gqa
        and num_heads > 1
        and _static_dim(past_key, 1) == 1
        and _static_dim(past_value, 1) == 1
    )


def _roles(graph: ir.Graph, pasts: list[ir.Value]) -> ProbeInputs:
    names = {v.name for v in graph.inputs}
    token_inputs = [spec.name for spec in signature.TOKEN_INPUTS]  # the export's names are the signature's
    for required in token_inputs:
        if required not in names:
            raise FusionError(
                f"the cache graph has no `{required}` input; the paged signature needs it. "
                "Re-export with optimum-style inputs (input_ids, attention_mask, position_ids, past_key_values.*)."
            )
    mask = "attention_mask" if "attention_mask" in names else None
    return ProbeInputs(*token_inputs, mask, tuple(pasts))


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
    num_heads, hkv, head_dim = _head_dims(match, _past_of(k_cat.inputs[0]), _past_of(v_cat.inputs[0]), ctx)
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
        scale=match.scale_for(head_dim),
        window=meaning.window,
        alibi_slopes=slopes,
    )


def _layer_index(layer: PagedLayer, graph: ir.Graph) -> tuple[int, int]:
    found = re.search(r"\.(\d+)\.", layer.past_key.name or "")
    position = list(graph.inputs).index(layer.past_key)
    return (int(found.group(1)) if found else position, position)


def _unread_pasts(layers: list[PagedLayer], model: ir.Model) -> list[str]:
    """Past inputs of cache Concats that no proven layer reads: the all-or-nothing rewrite must refuse then."""
    matched = {id(layer.past_key) for layer in layers} | {id(layer.past_value) for layer in layers}
    pasts = [_past_of(concat.inputs[0]) for concat in cache_concats(model.graph)]
    return [past.name for past in pasts if id(past) not in matched]



def prove_layers(model: ir.Model, ctx: PassContext) -> list[PagedLayer]:
    """Every cache attention of ``model``, proven, in layer order; FusionError unless all of them are."""
    graph = model.graph
    concats = cache_concats(graph)
    pasts = [_past_of(c.inputs[0]) for c in concats] or [v for v in graph.inputs if "past" in (v.name or "")]
    derive_position_ids(model, pasts)
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
    return layers
