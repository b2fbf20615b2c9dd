"""Rule: SwiGLU's SiLU·mul → trtopt.SiluMul (ONNX has no SiLU op up to opset 23; its body is the same three ops).

    y = (g · Sigmoid(g)) · u     (either operand order of both Muls)   →   y = SiluMul(g, u)

as both exporters write HF's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = SiLU``. Three pointwise kernels
per layer that each read and write the [T, intermediate] tensor become one (a Triton kernel in the torch executor
on CUDA; on CPU the same arithmetic with one allocation instead of three; TensorRT inlines the body and fuses it).

Matched only when the SiLU value has no other reader (else it would be computed twice) and g and u are known to
have one dtype and one shape (a broadcasting Mul is not SwiGLU). A SiLU left alone is recorded in the trace with
the reason, for ``trtopt build --explain``.
"""

from __future__ import annotations

import onnx_ir as ir

from trtopt.fusion_passes.gated_mul import gate_up_mul, other_operand, replace_gated
from trtopt.fusion_passes.ir_helpers import is_op
from trtopt.fusion_passes.ops import declare_domain
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "silu_mul"


def _silu(sigmoid: ir.Node) -> ir.Node | None:
    """The ``Mul(g, Sigmoid(g))`` that reads this Sigmoid, or None when the Sigmoid is not a SiLU."""
    g = sigmoid.inputs[0]
    uses = list(sigmoid.outputs[0].uses())
    if len(uses) != 1 or not is_op(uses[0].node, "Mul") or other_operand(uses[0].node, sigmoid.outputs[0]) is not g:
        return None
    return uses[0].node


def fuse_silu_mul(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every SwiGLU SiLU·mul into trtopt.SiluMul; returns the count (one per layer on Llama-family models)."""
    graph = model.graph
    count = 0
    for sigmoid in [n for n in graph if is_op(n, "Sigmoid")]:
        silu = _silu(sigmoid)
        if silu is None:
            continue
        g = sigmoid.inputs[0]
        try:
            mul, up = gate_up_mul(silu.outputs[0], g, "SiLU")
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, silu.name or "", e)
            continue
        replace_gated(graph, mul, "SiluMul", RULE, g, up, dead=[silu, sigmoid])
        count += 1
    if count:
        declare_domain(model)
    return count
