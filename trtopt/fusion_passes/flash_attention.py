"""Rule: attention without a KV cache (encoders, prefill-only graphs) → trtopt.FlashAttention.

The mask is passed through unchanged as the additive ``attn_bias`` (a Where-form mask becomes
Where(cond, 0, fill)), so the fused node computes exactly softmax(q·kᵀ·scale + bias)·v whatever the mask holds:
padding, causal, or both. ``causal`` is therefore always 0 here; the bias carries it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt.fusion_passes.attention_match import AttentionMatch, is_attention_anchor, match_attention
from trtopt.fusion_passes.context import PassContext
from trtopt.fusion_passes.ops import cast_like_original, declare_domain, replace_value, trtopt_node
from trtopt.fusion_passes.trace import NoMatch

RULE = "flash_attention"


def _head_counts(match: AttentionMatch, ctx: PassContext) -> tuple[int, int, int]:
    def static(value: ir.Value, axis: int) -> int | None:
        if value.shape is None or len(value.shape) != 4:
            return None
        dim = value.shape[axis]
        return dim if isinstance(dim, int) else None

    num_heads = static(match.q, 1) or ctx.dims.num_heads
    hkv = static(match.v, 1) or (ctx.dims.num_kv_heads if match.repeat_kv or match.native_gqa else num_heads)
    head_dim = static(match.q, 3) or ctx.dims.head_dim
    if num_heads is None or hkv is None or head_dim is None:
        raise NoMatch("cannot tell the head counts from the graph; put the model's config.json next to it")
    if not match.heads_consistent(num_heads, hkv):
        raise NoMatch(f"{num_heads} query heads and {hkv} kv heads do not match the graph's repeat_kv")
    return num_heads, hkv, head_dim


def _bias(match: AttentionMatch, graph: ir.Graph) -> tuple[ir.Value | None, list[ir.Node]]:
    """The additive bias for the op, plus any node that has to be created for it."""
    mask = match.mask
    if mask is None:
        return None, []
    if mask.kind == "add":
        return mask.value, []
    dtype = match.q.dtype
    zero = ir.Value(name=f"{match.softmax.name}.bias_zero", const_value=ir.tensor(np.array(0.0, dtype=dtype.numpy())))
    fill = ir.Value(
        name=f"{match.softmax.name}.bias_fill", const_value=ir.tensor(np.array(mask.fill, dtype=dtype.numpy()))
    )
    for value in (zero, fill):
        value.shape, value.type = ir.Shape([]), ir.TensorType(dtype)
        graph.register_initializer(value)
    keep, drop = (zero, fill) if mask.kind == "where_keep" else (fill, zero)
    where = ir.Node("", "Where", [mask.value, keep, drop], name=f"{match.softmax.name}.bias")
    return where.outputs[0], [where]


def fuse_flash_attention(model: ir.Model, ctx: PassContext) -> int:
    """Replace each provable attention of a cache-free graph by FlashAttention; return the count."""
    graph = model.graph
    count = 0
    for softmax in [n for n in graph if is_attention_anchor(n)]:
        try:
            match = match_attention(softmax)
            if match.heads_folded:
                raise NoMatch("heads-folded [B·H, S, D] attention (BLOOM) is only fused in cache graphs")
            if match.k.producer() is not None and match.k.producer().op_type == "Concat":
                raise NoMatch("keys are concatenated with a past; that is the paged rule's case")
            num_heads, hkv, head_dim = _head_counts(match, ctx)
            scale = match.scale_for(head_dim)
        except NoMatch as e:
            ctx.trace.fail(RULE, softmax.name or "Softmax", e)
            continue
        bias, extra = _bias(match, graph)
        k = match.k
        if not match.k_heads_second:
            # k: [B, S, H, D] → [B, H, S, D], the op's layout (the graph had folded this into kᵀ).
            to_heads = ir.Node(
                "", "Transpose", [k], [ir.AttrInt64s("perm", [0, 2, 1, 3])], name=f"{softmax.name}.k_bhsd"
            )
            extra.append(to_heads)
            k = to_heads.outputs[0]
        attrs = [
            ir.AttrInt64("num_heads", num_heads),
            ir.AttrInt64("num_kv_heads", hkv),
            ir.AttrInt64("head_dim", head_dim),
            ir.AttrFloat32("scale", scale),
            ir.AttrInt64("causal", 0),
        ]
        node = trtopt_node(
            "FlashAttention", [match.q, k, match.v, bias], attrs, num_outputs=1, name=f"FlashAttention_{count}"
        )
        node.outputs[0].name = f"flash_attention.{count}.out"
        node.outputs[0].shape = match.out.shape
        node.outputs[0].type = ir.TensorType(match.q.dtype) if match.q.dtype is not None else match.out.type
        graph.insert_after(match.out_node, [*extra, node])
        replace_value(match.out, cast_like_original(graph, node.outputs[0], match.out, node))
        count += 1
    if count:
        declare_domain(model)
    return count
