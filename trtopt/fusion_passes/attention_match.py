"""Structural matcher for one scaled-dot-product attention region, anchored at its Softmax.

Shared by the FlashAttention and PagedAttention rules. It walks out from the Softmax and accepts only the forms
that the exporters produce and that we can prove equal to ``softmax(q·kᵀ·scale + mask)·v``:

    scores = MatMul(q·s_q, K(k)·s_k) [·c | /c] [+ mask | Where(cond, ·, fill)]
    probs  = Softmax(scores, axis=-1) [Where(IsNaN(probs), 0, probs)]
    out    = MatMul(probs, V(v))

where s_q, s_k, c are scalar constants (the dynamo exporter applies √scale to both q and k), K(·) is an optional
repeat_kv (Unsqueeze(2)→Expand→Reshape) followed by a transpose of the last two axes (a Transpose, or the
Reshape→Transpose(0,2,1)→Reshape form of the dynamo exporter), and V(·) is an optional repeat_kv. Anything else
raises ``NoMatch`` with the failing check, so an unproven pattern is never rewritten.

BLOOM attends with heads folded into the batch (3-D bmm on [B·H, S, D]) and adds its ALiBi bias inside:

    scores = Reshape_4d(MatMul(Fold(q), Transpose(0,2,1)(Fold(k)))·c [+ bias]) + mask
    out    = MatMul(Fold(Softmax(scores)), Fold(v))

Each Fold/Reshape_4d is accepted only when the exporter's shapes prove it merges/splits exactly the (B, H) axes;
the bias is then a second additive term that the mask probe evaluates (an ALiBi bias becomes ``alibi_slopes``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from trtopt.fusion_passes.head_dim_scale import HeadDimFactor, head_dim_factor
from trtopt.fusion_passes.ir_helpers import int_list_constant, is_float_cast, perm, same_dims, scalar_constant
from trtopt.fusion_passes.trace import NoMatch

# An additive mask value at or below this counts as "masked out" (HF uses finfo.min, exporters use -inf).
MASKED = -1.0e4
# What a boolean "do not attend" becomes in an additive bias (finite, so a fully masked row gives no NaN).
MASKED_FILL = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """How the mask enters the scores; ``value`` is the tensor the mask probe evaluates."""

    # "add": scores + value · "where_keep": Where(value, scores, fill) · "where_drop": Where(value, fill, scores)
    kind: str
    value: ir.Value  # the additive bias or the boolean condition
    fill: float = 0.0  # the masked-out score for the Where forms
    # A second additive term on the heads-folded scores (BLOOM's ALiBi): [B·H, 1 | T, S], added before the mask.
    folded_bias: ir.Value | None = None


@dataclasses.dataclass(frozen=True)
class AttentionMatch:
    """One matched attention region. q/k/v are the tensors at the op boundary: [B, H, T, D]."""

    softmax: ir.Node
    q: ir.Value  # [B, Hq, T, D], before any scale
    k: ir.Value  # [B, Hkv, Tk, D] before repeat_kv and transpose (the Concat output in a cache graph),
    #             or [B, Tk, Hkv, D] when k_heads_second is False
    k_heads_second: bool
    v: ir.Value  # [B, Hkv, Tk, D], before repeat_kv
    scale: float
    mask: MaskSpec | None
    out: ir.Value  # the output of MatMul(probs, v): [B, Hq, T, D]
    out_node: ir.Node
    repeat_kv: bool  # k and v were repeated to the query heads (GQA)
    k_repeated: ir.Value  # k after repeat_kv, before the transpose: [B, Hq, Tk, D]
    v_repeated: ir.Value  # v after repeat_kv: [B, Hq, Tk, D]
    guard_nodes: tuple[ir.Node, ...]  # IsNaN/Where guards around the Softmax (dead after the rewrite)
    native_gqa: bool = False  # the op itself maps query head h to kv head h // (Hq / Hkv) (ONNX Attention)
    heads_folded: bool = False  # the 3-D bmm form: ``out`` is [B·Hq, T, D] (q/k/v above are still 4-D)
    # Factors of the scores computed from the head dim (SDPA's 1/√q.size(-1) traced from a Shape); ``scale`` is
    # the constant part, ``scale_for`` the whole.
    head_dim_factors: tuple[HeadDimFactor, ...] = ()

    def scale_for(self, head_dim: int) -> float:
        """The attention scale once the head dim is proven: the constant part times every head-dim factor."""
        scale = self.scale
        for factor in self.head_dim_factors:
            scale *= factor.evaluate(head_dim)
        return _checked_scale(scale, self.softmax)

    def heads_consistent(self, num_heads: int, num_kv_heads: int) -> bool:
        """Do these head counts fit how the graph maps query heads to kv heads?"""
        if num_heads % num_kv_heads != 0:
            return False
        if self.repeat_kv:
            return num_heads != num_kv_heads
        return self.native_gqa or num_heads == num_kv_heads


def _producer(value: ir.Value | None, what: str, near: ir.Node) -> ir.Node:
    node = value.producer() if value is not None else None
    if node is None:
        raise NoMatch(f"{what} is a graph input or initializer, not computed", near.name or "")
    return node


def _strip_scalar_scale(value: ir.Value) -> tuple[ir.Value, float]:
    """Walk back through Mul/Div by scalar constants and float Casts; return the unscaled value and the product of
    the factors."""
    value, factor, shaped = _strip_scale(value)
    if shaped:
        raise NoMatch(f"{value.name} is scaled by a factor computed from a shape here")
    return value, factor


def _strip_scale(value: ir.Value) -> tuple[ir.Value, float, tuple[HeadDimFactor, ...]]:
    """_strip_scalar_scale that also walks through Mul by a factor computed from Shape(x) (head_dim_scale): those
    are returned for the caller to prove (x must be an operand of QKᵀ) and evaluate."""
    factor = 1.0
    shaped: list[HeadDimFactor] = []
    while True:
        node = value.producer()
        if is_float_cast(node):
            value = node.inputs[0]
            continue
        if node is None or node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
            return value, factor, tuple(shaped)
        a, b = node.inputs
        cb = scalar_constant(b)
        ca = scalar_constant(a) if node.op_type == "Mul" else None
        if cb is not None:
            factor *= cb if node.op_type == "Mul" else 1.0 / cb
            value = a
        elif ca is not None:
            factor *= ca
            value = b
        elif node.op_type == "Mul" and (found := head_dim_factor(b) or head_dim_factor(a)) is not None:
            shaped.append(found)
            value = a if found.value is b else b
        else:
            return value, factor, tuple(shaped)


def _strip_repeat_kv(value: ir.Value) -> tuple[ir.Value, bool]:
    """Undo HF's repeat_kv: x[:, :, None].expand(B, Hkv, n, T, D).reshape(B, Hkv·n, T, D).

    The expand inserts the copies right after each kv head, so query head h reads kv head h // n, which is what
    the trtopt ops do. A Tile (h % Hkv) would be a different mapping and is not accepted here.
    """
    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return value, False
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand":
        return value, False
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return value, False
    axes = int_list_constant(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else None
    if axes is None and "axes" in unsqueeze.attributes:
        axes = list(unsqueeze.attributes["axes"].value)
    if axes != [2]:
        raise NoMatch(f"repeat_kv-like Unsqueeze on axes {axes}, expected [2]", unsqueeze.name or "")
    return unsqueeze.inputs[0], True


def _strip_key_transpose(value: ir.Value) -> tuple[ir.Value, bool]:
    """Undo kᵀ: a Transpose of the last two axes, or Reshape→Transpose(0,2,1)→Reshape (dynamo's 3-D form).

    Returns (k, heads_second): heads_second is False when the transpose came straight from [B, S, H, D]
    (perm (0, 2, 3, 1), the legacy exporter's merged transposes); the rule then adds the [B, H, S, D] view.
    """
    node = value.producer()
    if node is None:
        raise NoMatch("key operand of QKᵀ is not computed")
    if node.op_type == "Transpose" and perm(node) == (0, 1, 3, 2):
        return node.inputs[0], True
    if node.op_type == "Transpose" and perm(node) == (0, 2, 3, 1):
        return node.inputs[0], False
    if node.op_type == "Reshape":
        transpose = node.inputs[0].producer()
        if transpose is not None and transpose.op_type == "Transpose" and perm(transpose) == (0, 2, 1):
            flatten = transpose.inputs[0].producer()
            if flatten is not None and flatten.op_type == "Reshape":
                # [B, H, S, D] → [B·H, S, D] → [B·H, D, S] → [B, H, D, S]: the outer reshapes only fold B·H.
                return flatten.inputs[0], True
    raise NoMatch(f"key operand of QKᵀ is {node.op_type}, not a transpose of the last two axes", node.name or "")


def _softmax_consumer(softmax: ir.Node) -> tuple[ir.Node, tuple[ir.Node, ...]]:
    """The MatMul that consumes the probabilities, looking through float Casts and the IsNaN/Where guard."""
    value = softmax.outputs[0]
    passed: list[ir.Node] = []
    while True:
        uses = [use.node for use in value.uses()]
        if len(uses) == 1 and uses[0].op_type == "MatMul":
            return uses[0], tuple(passed)
        if len(uses) == 1 and is_float_cast(uses[0]):
            passed.append(uses[0])
            value = uses[0].outputs[0]
            continue
        if len(uses) == 1 and uses[0].op_type == "Reshape" and not any(n.op_type == "Reshape" for n in passed):
            if not _is_head_fold(uses[0]):
                raise NoMatch(
                    "Softmax output is reshaped, but not provably [B, H, T, S] → [B·H, T, S]", softmax.name or ""
                )
            passed.append(uses[0])
            value = uses[0].outputs[0]
            continue
        isnan = [n for n in uses if n.op_type == "IsNaN"]
        where = [n for n in uses if n.op_type == "Where"]
        if len(isnan) == 1 and len(where) == 1 and len(uses) == 2:
            guard = where[0]
            if (
                guard.inputs[0] is isnan[0].outputs[0]
                and guard.inputs[2] is value
                and scalar_constant(guard.inputs[1]) == 0.0
            ):
                passed += [isnan[0], guard]
                value = guard.outputs[0]
                continue
        raise NoMatch(
            f"Softmax output feeds {sorted(n.op_type for n in uses)}, not MatMul(probs, v)", softmax.name or ""
        )


def _ranked_shapes(node: ir.Node) -> tuple[ir.Shape, ir.Shape] | None:
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    return None if src is None or dst is None else (src, dst)


def _is_head_fold(node: ir.Node) -> bool:
    """Reshape [B, H, S, X] → [B·H, S, X]: row-major, so element (b, h, s, x) lands at (b·H + h, s, x).

    Proven from the exporter's shapes: same S and X, rank 4 → 3, so the first axis can only be B·H.
    """
    shapes = _ranked_shapes(node)
    if node.op_type != "Reshape" or shapes is None:
        return False
    src, dst = shapes
    return len(src) == 4 and len(dst) == 3 and same_dims(src[2], dst[1]) and same_dims(src[3], dst[2])


def _is_head_unfold(node: ir.Node, heads) -> bool:
    """Reshape [B·H, T, S] → [B, H, T, S] with H the heads of the fold (so it undoes it exactly)."""
    shapes = _ranked_shapes(node)
    if node.op_type != "Reshape" or shapes is None:
        return False
    src, dst = shapes
    return (
        len(src) == 3
        and len(dst) == 4
        and same_dims(src[1], dst[2])
        and same_dims(src[2], dst[3])
        and same_dims(dst[1], heads)
    )


def _unfold_head_fold(value: ir.Value, what: str) -> ir.Value:
    """The 4-D [B, H, S, D] tensor behind a proven head fold."""
    node = value.producer()
    if node is None or not _is_head_fold(node):
        raise NoMatch(f"{what} is not provably a [B, H, S, D] → [B·H, S, D] fold", node.name if node else "")
    return node.inputs[0]


def _folded_scores(value: ir.Value) -> tuple[ir.Value, ir.Value | None, ir.Node] | None:
    """Reshape_4d(scores₃ [+ bias₃]): (scores₃, bias₃, the reshape), or None when this is not that form."""
    unfold = value.producer()
    if unfold is None or unfold.op_type != "Reshape":
        return None
    inner = unfold.inputs[0]
    if _is_qk(inner):
        return inner, None, unfold
    add = inner.producer()
    if add is None or add.op_type != "Add":
        return None
    a, b = add.inputs
    if _is_qk(a):
        return a, b, unfold
    if _is_qk(b):
        return b, a, unfold
    return None


def _is_qk(value: ir.Value) -> bool:
    producer = _strip_scale(value)[0].producer()
    return producer is not None and producer.op_type == "MatMul"


def _mask_of(scores: ir.Value) -> tuple[ir.Value, MaskSpec | None, ir.Node | None]:
    """Split the Softmax input into the raw (scaled) scores, the mask and, for the heads-folded form, the
    Reshape that unfolds the scores to [B, H, T, S]."""
    node = scores.producer()
    if node is not None and node.op_type == "Add":
        a, b = node.inputs
        # The scores side is the one that comes from the QKᵀ MatMul (possibly through a scale).
        if _is_qk(a):
            return a, MaskSpec("add", b), None
        if _is_qk(b):
            return b, MaskSpec("add", a), None
        for scores_side, mask_side in ((a, b), (b, a)):
            folded = _folded_scores(scores_side)
            if folded is not None:
                raw, bias, unfold = folded
                return raw, MaskSpec("add", mask_side, folded_bias=bias), unfold
        raise NoMatch("Add before Softmax has no QKᵀ operand", node.name or "")
    if node is not None and node.op_type == "Where":
        cond, x, y = node.inputs
        fill_y, fill_x = scalar_constant(y), scalar_constant(x)
        if fill_y is not None and fill_y <= MASKED:
            return x, MaskSpec("where_keep", cond, fill_y), None
        if fill_x is not None and fill_x <= MASKED:
            return y, MaskSpec("where_drop", cond, fill_x), None
        raise NoMatch("Where before Softmax does not fill with a large negative constant", node.name or "")
    return scores, None, None


def match_attention(softmax: ir.Node) -> AttentionMatch:
    """Match the attention region anchored at ``softmax`` (or at an ONNX Attention op) or raise NoMatch with the
    failing check."""
    if softmax.op_type == "Attention":
        return _match_onnx_attention(softmax)
    axis = softmax.attributes.get("axis")
    if axis is not None and axis.value not in (-1, 3):
        raise NoMatch(f"Softmax over axis {axis.value}, not the key axis", softmax.name or "")
    out_node, guards = _softmax_consumer(softmax)
    probs_side = out_node.inputs[0]
    expected = guards[-1].outputs[0] if guards else softmax.outputs[0]
    if probs_side is not expected:
        raise NoMatch("probabilities are the right operand of the output MatMul", out_node.name or "")

    raw_scores, mask, unfold = _mask_of(softmax.inputs[0])
    scores, post_scale, post_shaped = _strip_scale(raw_scores)
    qk = _producer(scores, "the Softmax input", softmax)
    if qk.op_type != "MatMul":
        raise NoMatch(f"scores come from {qk.op_type}, not a QKᵀ MatMul", qk.name or "")
    probs_folded = any(n.op_type == "Reshape" for n in guards)
    if (unfold is not None) != probs_folded:
        raise NoMatch("scores and probabilities are not both in the heads-folded [B·H, T, S] form", qk.name or "")
    region = _Region(softmax, qk, post_scale, mask, out_node, guards, post_shaped)
    if unfold is not None:
        return _match_folded(region, unfold)

    q, q_scale, q_shaped = _strip_scale(qk.inputs[0])
    k_t, k_scale, k_shaped = _strip_scale(qk.inputs[1])
    k_rep, heads_second = _strip_key_transpose(k_t)
    return _finish(region, q=q, q_scale=q_scale, k_scale=k_scale, k_operand=k_rep, k_heads_second=heads_second,
                   v_operand=out_node.inputs[1], heads_folded=False, shaped=q_shaped + k_shaped)


@dataclasses.dataclass(frozen=True)
class _Region:
    """The parts of a Softmax-anchored region that the plain and heads-folded forms share."""

    softmax: ir.Node
    qk: ir.Node  # the QKᵀ MatMul
    post_scale: float  # the scalar factor between QKᵀ and the mask
    mask: MaskSpec | None
    out_node: ir.Node  # MatMul(probs, v)
    guards: tuple[ir.Node, ...]
    post_shaped: tuple[HeadDimFactor, ...] = ()  # factors from a shape between QKᵀ and the mask


def _finish(
    region: _Region,
    *,
    q: ir.Value,
    q_scale: float,
    k_scale: float,
    k_operand: ir.Value,
    k_heads_second: bool,
    v_operand: ir.Value,
    heads_folded: bool,
    shaped: tuple[HeadDimFactor, ...] = (),
) -> AttentionMatch:
    """The match ending both forms share: the keys' inner scale and repeat_kv, the values, the total scale."""
    k_rep, k_scale_inner, k_shaped = _strip_scale(k_operand)
    shaped += k_shaped + region.post_shaped
    k, k_repeated = _strip_repeat_kv(k_rep)
    # A factor read off a shape is the head dim's only if it reads an operand of QKᵀ (last dim = contraction dim).
    operands = {id(q), id(k_operand), id(k_rep), id(k)}
    for found in shaped:
        if id(found.source) not in operands:
            raise NoMatch(f"the scale {found.value.name} reads the shape of {found.source.name}, not of q or k",
                          region.qk.name or "")
    if not k_heads_second and k_repeated:
        raise NoMatch("keys are repeated to the query heads in [B, S, H, D] layout", region.qk.name or "")
    v_side, v = _match_values(v_operand, region.out_node, k_repeated)
    scale = _checked_scale(region.post_scale * q_scale * k_scale * k_scale_inner, region.qk)
    return AttentionMatch(
        softmax=region.softmax,
        q=q,
        k=k,
        k_heads_second=k_heads_second,
        v=v,
        scale=scale,
        mask=region.mask,
        out=region.out_node.outputs[0],
        out_node=region.out_node,
        repeat_kv=k_repeated,
        k_repeated=k_rep,
        v_repeated=v_side,
        guard_nodes=region.guards,
        heads_folded=heads_folded,
        head_dim_factors=shaped,
    )


def _match_values(value: ir.Value, out_node: ir.Node, k_repeated: bool) -> tuple[ir.Value, ir.Value]:
    """The value operand of the output MatMul → (as used, before any repeat_kv). Values must be unscaled and repeated
    to the query heads exactly as the keys are."""
    v_side, v_scale = _strip_scalar_scale(value)  # only float Casts are expected here
    if v_scale != 1.0:
        raise NoMatch("values are scaled before the output MatMul", out_node.name or "")
    v, v_repeated = _strip_repeat_kv(v_side)
    if k_repeated != v_repeated:
        raise NoMatch("keys and values are not repeated to the query heads the same way", out_node.name or "")
    return v_side, v


def _checked_scale(scale: float, qk: ir.Node) -> float:
    if not math.isfinite(scale) or scale <= 0.0:
        raise NoMatch(f"attention scale {scale} is not a positive finite constant", qk.name or "")
    return scale


def _match_folded(region: _Region, unfold: ir.Node) -> AttentionMatch:
    """BLOOM's bmm attention: q, k, v folded to [B·H, S, D], the scores unfolded to [B, H, T, S] for the mask."""
    qk = region.qk
    q3, q_scale = _strip_scalar_scale(qk.inputs[0])
    q = _unfold_head_fold(q3, "the query operand of QKᵀ")
    k_t, k_scale = _strip_scalar_scale(qk.inputs[1])
    transpose = k_t.producer()
    if transpose is None or transpose.op_type != "Transpose" or perm(transpose) != (0, 2, 1):
        raise NoMatch("the key operand of the folded QKᵀ is not Transpose(0, 2, 1)", qk.name or "")
    k_rep = _unfold_head_fold(transpose.inputs[0], "the key operand of QKᵀ")
    v_folded = _unfold_head_fold(region.out_node.inputs[1], "the value operand of the output MatMul")
    heads = q.shape[1] if q.shape is not None and len(q.shape) == 4 else None
    if not _is_head_unfold(unfold, heads):
        raise NoMatch("the scores are not provably unfolded [B·H, T, S] → [B, H, T, S]", unfold.name or "")
    return _finish(region, q=q, q_scale=q_scale, k_scale=k_scale, k_operand=k_rep, k_heads_second=True,
                   v_operand=v_folded, heads_folded=True)


# The standard ONNX Attention op (opset 23), which the dynamo exporter emits for SDPA at opset >= 23.
_ONNX_ATTENTION_DEFAULTS = {"is_causal": 0, "qk_matmul_output_mode": 0, "softcap": 0.0}


def is_attention_anchor(node: ir.Node) -> bool:
    """The nodes an attention region is anchored at: a Softmax, or a standard ONNX Attention op."""
    return node.domain in ("", "ai.onnx") and node.op_type in ("Softmax", "Attention")


def _match_onnx_attention(node: ir.Node) -> AttentionMatch:
    """ONNX Attention with 4-D q/k/v [B, H, S, D], no internal cache, at most a mask: the same math as ours.

    is_causal=1 is refused: with a cache its alignment (top-left) differs from a decoder's, and the exporters
    pass the causal mask explicitly anyway.
    """
    name = node.name or "Attention"
    for attr, default in _ONNX_ATTENTION_DEFAULTS.items():
        value = node.attributes[attr].value if attr in node.attributes else default
        if value != default:
            raise NoMatch(f"Attention has {attr}={value}; only {attr}={default} is the plain attention", name)
    if "q_num_heads" in node.attributes or "kv_num_heads" in node.attributes:
        raise NoMatch("Attention takes 3-D [B, S, H·D] inputs; only the 4-D form is fused", name)
    if len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:]):
        raise NoMatch("Attention carries its own past key/value inputs", name)
    if any(len(list(out.uses())) or out.is_graph_output() for out in node.outputs[1:]):
        raise NoMatch("Attention's present/qk outputs are used", name)
    q, k_rep, v_rep = node.inputs[:3]
    k, k_repeated = _strip_repeat_kv(k_rep)
    v, v_repeated = _strip_repeat_kv(v_rep)
    if k_repeated != v_repeated:
        raise NoMatch("keys and values are not repeated to the query heads the same way", name)
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    spec = None
    if mask is not None:
        # A boolean mask says which keys to attend to; a float mask is added to the scores.
        spec = MaskSpec("where_keep", mask, MASKED_FILL) if mask.dtype == ir.DataType.BOOL else MaskSpec("add", mask)
    scale = node.attributes["scale"].value if "scale" in node.attributes else None
    if scale is None:
        head_dim = q.shape[3] if q.shape is not None and len(q.shape) == 4 else None
        if not isinstance(head_dim, int):
            raise NoMatch("Attention has no scale attribute and q's head_dim is not static", name)
        scale = head_dim**-0.5
    return AttentionMatch(
        softmax=node,
        q=q,
        k=k,
        k_heads_second=True,
        v=v,
        scale=float(scale),
        mask=spec,
        out=node.outputs[0],
        out_node=node,
        repeat_kv=k_repeated,
        k_repeated=k_rep,
        v_repeated=v_rep,
        guard_nodes=(),
        native_gqa=True,
    )
