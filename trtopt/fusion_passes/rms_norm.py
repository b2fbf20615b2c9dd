"""Rule: decomposed RMSNorm → RMSNormalization (opset ≥ 23) or trtopt.RMSNorm (its body is the same math).

    y = scale · x / sqrt(mean(x², axis=-1) + eps)

as HF Llama/Qwen2 write it: Pow(x, 2) → ReduceMean(-1) → Add(eps) → Sqrt → Reciprocal|Div(1, ·) → Mul(x, ·),
then Mul by the weight, with the optional Casts of HF's fp16/bf16 path (x → fp32 at the start, back at the end).
Both Mul orders are matched (``commute``); ReduceMean's axes may be an input (opset ≥ 18) or an attribute.

Gemma / Gemma-3 in fp16/bf16 scale *before* the downcast, by an fp32 weight (``(x.float() normed · (1 + w.float()))
.type_as(x)``): the fp16 input and fp32 weight disagree, so the norm is fused in fp32 between the exported Casts
(``Cast → RMSNorm → Cast``, the same math as the original), by the ``upcast=False`` rules that bind x after the Cast.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from trtopt.fusion_passes.ir_helpers import FLOAT_TYPES, int_list_constant, scalar_constant
from trtopt.fusion_passes.ops import DOMAIN, declare_domain

RULE = "rms_norm"


class _RmsNorm(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, *, axes_as_input: bool, reciprocal: bool, upcast: bool = True):
        super().__init__(name)
        self._axes_as_input = axes_as_input
        self._reciprocal = reciprocal
        self._upcast = upcast

    def pattern(self, op, x, scale, epsilon, axes, one):
        # HF upcasts fp16/bf16 to fp32 first; x binds to the tensor before that Cast, so the fused op sees the
        # model's dtype (its body and RMSNormalization's stash_type do the fp32 math themselves).
        # (tag_var is given because onnxscript 0.7.2 cannot clone an untagged backtracking OrValue for commute.)
        if self._upcast:
            x = pattern.OrValue([op.Cast(x, _allow_other_attributes=True), x], tag_var="upcast",
                                tag_values=[True, False])
        x_square = op.Pow(x, 2.0)
        if self._axes_as_input:
            mean_square = op.ReduceMean(x_square, axes, keepdims=1, _allow_other_attributes=True)
        else:
            mean_square = op.ReduceMean(x_square, axes=[-1], keepdims=1, _allow_other_attributes=True)
        rms = op.Sqrt(op.Add(mean_square, epsilon))
        inv = op.Reciprocal(rms) if self._reciprocal else op.Div(one, rms)
        normalized = op.Mul(x, inv)
        normalized = pattern.OrValue([op.Cast(normalized, _allow_other_attributes=True), normalized])
        return op.Mul(scale, normalized)

    def check(self, context, x, scale, epsilon, axes=None, one=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if scalar_constant(epsilon) is None:
            return result.fail("epsilon is not a scalar constant", epsilon)
        if self._axes_as_input and int_list_constant(axes) != [-1]:
            return result.fail("ReduceMean is not over the last axis only", axes)
        if not self._reciprocal and scalar_constant(one) != 1.0:
            return result.fail("Div numerator is not 1", one)
        if x.dtype is not None and x.dtype not in FLOAT_TYPES:
            return result.fail("input is not a float tensor", x)
        # The fused output has x's dtype; the original's is the weight's (HF: weight * normalized.to(x.dtype)).
        if x.dtype is not None and scale.dtype is not None and x.dtype != scale.dtype:
            return result.fail("input and weight dtypes differ", scale)
        return result

    def rewrite(self, op, x, scale, epsilon, **_):
        return op.RMSNorm(x, scale, epsilon=scalar_constant(epsilon), _domain=DOMAIN)


class _RmsNormStandard(_RmsNorm):
    """The same match, rewritten to the standard opset-23 RMSNormalization."""

    def rewrite(self, op, x, scale, epsilon, **_):
        return op.RMSNormalization(x, scale, axis=-1, epsilon=scalar_constant(epsilon), stash_type=1)


def _rules(standard: bool) -> pattern.RewriteRuleSet:
    cls = _RmsNormStandard if standard else _RmsNorm
    # upcast=False comes second: it is reached only when the upcast form's check fails (Gemma's fp32 weight).
    rules = [cls.rule(f"RMSNorm_{a}_{r}_{u}", axes_as_input=a, reciprocal=r, upcast=u)
             for u in (True, False) for a in (True, False) for r in (True, False)]
    return pattern.RewriteRuleSet(rules, commute=True)


def fuse_rms_norm(model: ir.Model) -> int:
    """Fuse every decomposed RMSNorm; returns the count."""
    standard = model.opset_imports.get("", 0) >= 23
    count = _rules(standard).apply_to_model(model)
    if count and not standard:
        declare_domain(model)
    return count
