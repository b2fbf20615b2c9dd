"""Rule: decomposed LayerNorm → the standard LayerNormalization (opset ≥ 17).

    y = (x − mean(x)) / sqrt(var(x) + eps) · scale + bias,   over the last axis

matched as ReduceMean → Sub → Pow(2)|Mul(d, d) → ReduceMean → Add(eps) → Sqrt → Div|Mul(Reciprocal) → Mul(scale)
→ Add(bias), with ReduceMean's axes as an input (opset ≥ 18) or an attribute, and both operand orders.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from trtopt.fusion_passes.ir_helpers import int_list_constant, scalar_constant

RULE = "layer_norm"


class _LayerNorm(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, *, axes_as_input: bool, reciprocal: bool):
        super().__init__(name)
        self._axes_as_input = axes_as_input
        self._reciprocal = reciprocal

    def _mean(self, op, x, axes):
        if self._axes_as_input:
            return op.ReduceMean(x, axes, keepdims=1, _allow_other_attributes=True)
        return op.ReduceMean(x, axes=[-1], keepdims=1, _allow_other_attributes=True)

    def pattern(self, op, x, scale, bias, epsilon, axes, axes2):
        deviation = op.Sub(x, self._mean(op, x, axes))
        squared = pattern.OrValue([op.Pow(deviation, 2.0), op.Mul(deviation, deviation)])
        std = op.Sqrt(op.Add(self._mean(op, squared, axes2), epsilon))
        normalized = op.Mul(deviation, op.Reciprocal(std)) if self._reciprocal else op.Div(deviation, std)
        return op.Add(op.Mul(normalized, scale), bias)

    def check(self, context, x, scale, bias, epsilon, axes=None, axes2=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if scalar_constant(epsilon) is None:
            return result.fail("epsilon is not a scalar constant", epsilon)
        if self._axes_as_input and (int_list_constant(axes) != [-1] or int_list_constant(axes2) != [-1]):
            return result.fail("ReduceMean is not over the last axis only", axes)
        for value in (scale, bias):
            if value.const_value is None or len(value.const_value.shape) != 1:
                return result.fail("scale/bias are not 1-D constants", value)
        return result

    def rewrite(self, op, x, scale, bias, epsilon, **_):
        return op.LayerNormalization(x, scale, bias, axis=-1, epsilon=scalar_constant(epsilon), stash_type=1)


_RULES = pattern.RewriteRuleSet(
    [
        _LayerNorm.rule(f"LayerNorm_{a}_{r}", axes_as_input=a, reciprocal=r)
        for a in (True, False)
        for r in (True, False)
    ],
    commute=True,
)


def fuse_layer_norm(model: ir.Model) -> int:
    """Fuse every decomposed LayerNorm; returns the count (0 below opset 17, where the op does not exist)."""
    if model.opset_imports.get("", 0) < 17:
        return 0
    return _RULES.apply_to_model(model)
