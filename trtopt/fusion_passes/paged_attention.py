"""Rule: attention with a KV cache → trtopt.PagedAttention, and the graph rewritten to the paged signature (§3).

paged_layers proves every cache attention (all or nothing); this module then replaces each by one PagedAttention
node that takes the *new* k/v, writes them into the layer's pool and attends over the pool, and rewrites the
graph's I/O: the past/present tensors and the mask go, the pools and the per-step tensors come in.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from trtopt import signature
from trtopt.errors import FusionError
from trtopt.fusion_passes.context import PassContext
from trtopt.fusion_passes.ir_helpers import infer_missing_shapes, int64_initializer
from trtopt.fusion_passes.ops import cast_like_original, declare_domain, trtopt_node
from trtopt.plugins.common import DOMAIN
from trtopt.plugins.paged_attention.function import FP8_MIN_OPSET
from trtopt.fusion_passes.paged_layers import PagedLayer, has_cache_io, prove_layers
from trtopt.fusion_passes.shape_rebind import rebind_cache_shapes

__all__ = ["SOURCE_OUTPUT_KEY", "fuse_paged_attention", "has_cache_io", "use_fp8_kv_cache"]

# Node metadata on each PagedAttention: the name of the original graph's attention output that the node replaces
# (MatMul(probs, v) or the Attention op's output, [B, Hq, T, D] or [B·Hq, T, D]). `trtopt check --layerwise`
# marks it in the original export to compare layer by layer.
SOURCE_OUTPUT_KEY = "trtopt.source_output"


def _new_input(name: str, dtype: ir.DataType, dims: Sequence[int | str]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(list(dims)), type=ir.TensorType(dtype))


def _signature_input(spec: signature.TensorSpec) -> ir.Value:
    return _new_input(spec.name, ir.DataType.from_numpy(np.dtype(spec.dtype)), spec.dims)


def _step_tensors() -> list[ir.Value]:
    """The per-step attention metadata shared by every layer (§3), in the op's input order."""
    return [_signature_input(spec) for spec in signature.ATTENTION_METADATA]


def _slopes_initializer(graph: ir.Graph, layer: PagedLayer, index: int) -> ir.Value | None:
    """The proven ALiBi slopes as the op's float32 [Hq] ``alibi_slopes`` input."""
    if layer.alibi_slopes is None:
        return None
    tensor = ir.tensor(np.array(layer.alibi_slopes, dtype=np.float32), name=f"alibi_slopes.{index}")
    value = ir.Value(name=tensor.name, const_value=tensor)
    value.shape, value.type = ir.Shape([layer.num_heads]), ir.TensorType(ir.DataType.FLOAT)
    graph.register_initializer(value)
    return value


def _paged_node(
    layer: PagedLayer, index: int, cache: ir.Value, step: list[ir.Value], slopes: ir.Value | None
) -> ir.Node:
    m = layer.match
    attrs = [
        ir.AttrInt64("num_heads", layer.num_heads),
        ir.AttrInt64("num_kv_heads", layer.num_kv_heads),
        ir.AttrInt64("head_dim", layer.head_dim),
        ir.AttrFloat32("scale", layer.scale),
        ir.AttrInt64("causal", 1),
        ir.AttrInt64("sliding_window", layer.window),
    ]
    inputs = [
        m.q,
        layer.k_new,
        layer.v_new,
        cache,
        *step,
        slopes,
    ]
    node = trtopt_node("PagedAttention", inputs, attrs, num_outputs=2, name=f"PagedAttention_{index}")
    node.metadata_props[SOURCE_OUTPUT_KEY] = m.out.name or ""
    out, cache_out = node.outputs
    out.name = f"paged_attention.{index}.out"
    out.shape = None if m.heads_folded else m.out.shape  # folded: [1, Hq, T, D], squeezed after
    out.type = ir.TensorType(m.q.dtype) if m.q.dtype is not None else m.out.type
    cache_out.name = signature.kv_output(index)
    cache_out.shape, cache_out.type = cache.shape, cache.type
    return node


def _insert_paged_nodes(
    graph: ir.Graph, layers: list[PagedLayer], block_size: int, step: list[ir.Value]
) -> tuple[list[ir.Value], list[ir.Value]]:
    """One PagedAttention per layer, read by whatever read the old attention output; returns the pool I/O."""
    cache_inputs, cache_outputs = [], []
    for index, layer in enumerate(layers):
        dims = signature.kv_dims("num_blocks", layer.num_kv_heads, block_size, layer.head_dim)
        cache = _new_input(signature.kv_input(index), layer.past_key.dtype, dims)
        node = _paged_node(layer, index, cache, step, _slopes_initializer(graph, layer, index))
        graph.insert_after(layer.match.out_node, node)
        out, last = node.outputs[0], node
        if layer.match.heads_folded:
            # The graph continues from bmm's [B·Hq, T, D]; the op gives [1, Hq, T, D] (batch is 1 when paged).
            axes = int64_initializer(graph, f"PagedAttention_{index}.squeeze_axes", [0])
            last = ir.Node("", "Squeeze", [out, axes], name=f"PagedAttention_{index}.unbatch")
            graph.insert_after(node, last)
            out = last.outputs[0]
            out.shape, out.type = layer.match.out.shape, node.outputs[0].type
        out = cast_like_original(graph, out, layer.match.out, last)
        ir.convenience.replace_all_uses_with(layer.match.out, out)
        cache_inputs.append(cache)
        cache_outputs.append(node.outputs[1])
    return cache_inputs, cache_outputs


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
            # Without repeat_kv these are the cache tensors themselves, which keep the kv heads (MQA broadcast).
            cut.setdefault(id(tensor), layer.num_heads)
        # (In the heads-folded form these are still the 4-D tensors before the fold; the 3-D folds stay dead
        # or are read only by the removed attention.)
    head_dims = {layer.head_dim for layer in layers}
    assert len(head_dims) == 1, f"layers disagree on head_dim: {head_dims}"
    input_ids = next(v for v in graph.inputs if v.name == signature.INPUT_IDS.name)
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
    ordered = []
    for spec in signature.TOKEN_INPUTS:
        ordered.append(by_name.pop(spec.name))
        ordered[-1].shape = ir.Shape(list(spec.dims))
    graph.inputs.extend(ordered + cache_inputs + list(by_name.values()))
    graph.inputs.extend(step)
    declare_domain(model)
    _forget_intermediate_shapes(graph)


def _forget_intermediate_shapes(graph: ir.Graph) -> None:
    """Drop the exporter's shapes of intermediate values: their symbols (batch, seq, past + seq) no longer mean
    what they said, and ORT plans buffer reuse from declared symbolic dims. Runtimes re-infer them."""
    for node in graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None


def fuse_paged_attention(model: ir.Model, ctx: PassContext, *, block_size: int) -> int:
    """Rewrite every cache attention to PagedAttention and the graph to the paged signature; return the count.

    Returns 0 for a graph without cache I/O. Raises FusionError when the graph has cache I/O but some of its
    attention could not be proven (the message lists the failed checks).
    """
    if not has_cache_io(model.graph):
        return 0
    try:
        layers = prove_layers(model, ctx)
    except FusionError as first:
        # TorchScript exports carry no intermediate shapes; with inferred ones the proof may go through (BLOOM's
        # heads-folded bmm). The first attempt's failures stand unless the retry proves every layer.
        failures = list(ctx.trace.failures)
        if not infer_missing_shapes(model):
            raise
        ctx.trace.failures.clear()
        try:
            layers = prove_layers(model, ctx)
        except FusionError:
            ctx.trace.failures[:] = failures
            raise first from None
    _rewrite(model, layers, block_size)
    return len(layers)


FP8_MIN_IR_VERSION = 9  # float8 tensor types came with IR version 9 (and float8 Cast with opset 19)


def use_fp8_kv_cache(model: ir.Model, *, k_scales: Sequence[float] | None = None,
                     v_scales: Sequence[float] | None = None) -> int:
    """Store the KV pools of a paged graph as float8_e4m3fn (`trtopt build --kv-cache-dtype fp8`); returns the number
    of PagedAttention nodes. Mutates ``model``.

    Every kv_cache.{i} input and kv_cache_out.{i} output becomes float8_e4m3fn, and each PagedAttention node gets
    kv_cache_dtype="fp8" and its layer's k_scale and v_scale (float32; 1.0 each without calibration, as vLLM uses
    without checkpoint scales). The standard opset is raised to 19 where it is lower (the op's body casts to float8):
    opset 19 changed its ops only by adding types and attributes whose defaults keep the opset-18 meaning.
    """
    nodes = [n for n in model.graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    k_scales = [1.0] * len(nodes) if k_scales is None else list(k_scales)
    v_scales = [1.0] * len(nodes) if v_scales is None else list(v_scales)
    assert len(k_scales) == len(v_scales) == len(nodes), (
        f"{len(nodes)} PagedAttention layers but {len(k_scales)} K and {len(v_scales)} V scales")
    fp8 = ir.DataType.from_numpy(np.dtype(signature.FP8_KV_DTYPE))
    for node, k_scale, v_scale in zip(nodes, k_scales, v_scales):
        for value in (node.inputs[3], node.outputs[1]):  # kv_cache, kv_cache_out (schema.py's order)
            assert value is not None and (signature.is_kv_input(value.name) or signature.is_kv_output(value.name)), (
                f"{node.name}: the pool I/O is {value and value.name!r}, not a graph pool")
            value.type = ir.TensorType(fp8)
        for attr in (ir.AttrString("kv_cache_dtype", "fp8"), ir.AttrFloat32("k_scale", float(k_scale)),
                     ir.AttrFloat32("v_scale", float(v_scale))):
            node.attributes[attr.name] = attr
    model.opset_imports[""] = max(model.opset_imports.get("", FP8_MIN_OPSET), FP8_MIN_OPSET)
    model.ir_version = max(model.ir_version or FP8_MIN_IR_VERSION, FP8_MIN_IR_VERSION)
    return len(nodes)
