"""Rule: MatMul + constant bias → Gemm on 2-D graphs, else trtopt.MatMulAdd (body: MatMul → Add).

Only a constant 2-D weight with a constant 1-D bias of the output width is fused: that is a linear layer. An Add
of an activation (a residual, or the mask added to QKᵀ) is left alone. Both Add operand orders match.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from trtopt.fusion_passes.ops import DOMAIN, declare_domain

RULE = "matmul_add"


def _linear_check(x: ir.Value, weight: ir.Value, bias: ir.Value) -> str | None:
    """None when (weight, bias) is a linear layer's, else why not."""
    w, b = weight.const_value, bias.const_value
    if w is None or b is None:
        return "weight or bias is not a constant"
    if len(w.shape) != 2 or len(b.shape) != 1 or b.shape[0] != w.shape[1]:
        return f"weight {tuple(w.shape)} / bias {tuple(b.shape)} are not a [K, N] / [N] pair"
    return None


class _Gemm(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, weight, bias):
        return op.Add(op.MatMul(x, weight), bias)

    def check(self, context, x, weight, bias, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        why = _linear_check(x, weight, bias)
        if why:
            return result.fail(why)
        if x.shape is None or len(x.shape) != 2:
            return result.fail("input is not known to be 2-D")
        return result

    def rewrite(self, op, x, weight, bias, **_):
        return op.Gemm(x, weight, bias)


class _MatMulAdd(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, weight, bias):
        return op.Add(op.MatMul(x, weight), bias)

    def check(self, context, x, weight, bias, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        why = _linear_check(x, weight, bias)
        return result.fail(why) if why else result

    def rewrite(self, op, x, weight, bias, **_):
        return op.MatMulAdd(x, weight, bias, _domain=DOMAIN)


_RULES = pattern.RewriteRuleSet([_Gemm.rule("MatMulAddToGemm"), _MatMulAdd.rule("MatMulAdd")], commute=True)


def fuse_matmul_add(model: ir.Model) -> int:
    """Fuse every linear MatMul + bias; returns the count."""
    count = _RULES.apply_to_model(model)
    if any(node.domain == DOMAIN and node.op_type == "MatMulAdd" for node in model.graph):
        declare_domain(model)
    return count
