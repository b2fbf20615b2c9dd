"""Rule: the residual Add and the trtopt.RMSNorm that reads it → trtopt.AddRMSNorm with two outputs.

    s = Add(x, residual);  y = RMSNorm(s, scale)      →      y, s = AddRMSNorm(x, residual, scale)

Every pre-norm decoder layer adds the attention (or MLP) output to the residual stream and normalises the sum for
the next block; the sum is also the next residual, hence the second output. The pair becomes one kernel that reads
both addends once and writes the sum and the normed row (TensorRT's "add + norm" fusion, in the plan). Runs after
rms_norm, on its trtopt.RMSNorm nodes: 2 per layer minus one (layer 0's input norm reads the embedding), plus the
final norm.

In fp16/bf16 Gemma-style plans the norm is fp32 and reads the half-precision sum through a Cast (rms_norm.py): the
Cast is absorbed too, and AddRMSNorm's fp32 scale makes it do the fp32 math (plugins/add_rms_norm/schema.py).

Matched only when the Add has two computed (non-constant) operands of the norm's input dtype: an Add of a constant
is a bias, not a residual. Such near misses are recorded in the trace for ``--explain``; a norm whose input is no
Add at all (the first layer's, on the embedding) is simply not a candidate. The standard RMSNormalization of
opset ≥ 23 exports is left as it is (no standard op adds first; a trtopt op there is future work).
"""

from __future__ import annotations

import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import is_constant, is_op
from trtopt.fusion_passes.ops import DOMAIN, declare_domain, replace_output
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "add_rms_norm"


def _upcast(norm: ir.Node) -> ir.Node | None:
    """The Cast to fp32 between a half-precision residual Add and an fp32 norm (Gemma's fp16/bf16 form, as
    rms_norm.py fuses it: ``Add → Cast → RMSNorm → Cast``), when the norm is its only reader; else None."""
    cast = norm.inputs[0].producer() if norm.inputs[0] is not None else None
    if not is_op(cast, "Cast") or cast.attributes["to"].value != ir.DataType.FLOAT:
        return None
    source, scale = cast.inputs[0], norm.inputs[1]
    if (source is None or source.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
            or scale is None or scale.dtype != ir.DataType.FLOAT or len(cast.outputs[0].uses()) != 1
            or cast.outputs[0].is_graph_output()):
        return None
    return cast if is_op(source.producer(), "Add") else None


def _residual_add(norm: ir.Node, upcast: ir.Node | None) -> ir.Node | None:
    """The Add that computes the norm's input (through ``upcast`` if given), or None when there is none; NoMatch
    when it is not a residual."""
    s = (upcast or norm).inputs[0]
    add = s.producer() if s is not None else None
    if not is_op(add, "Add"):
        return None
    for operand in add.inputs:
        if operand is None or is_constant(operand):
            raise NoMatch("the Add has a constant operand (a bias, not the residual stream)", add.name or "")
        if operand.dtype is not None and s.dtype is not None and operand.dtype != s.dtype:
            raise NoMatch(f"the Add's operands are {operand.dtype}, its sum {s.dtype}", add.name or "")
    return add


def fuse_add_rms_norm(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every residual Add + trtopt.RMSNorm; returns the count."""
    graph = model.graph
    count, computed_scale = 0, False
    for norm in [n for n in graph if n.domain == DOMAIN and n.op_type == "RMSNorm"]:
        upcast = _upcast(norm)
        try:
            add = _residual_add(norm, upcast)
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, norm.name or "", e)
            continue
        if add is None:
            continue
        s, y = add.outputs[0], norm.outputs[0]
        # No plugin_namespace: AddRMSNorm has no TensorRT plugin, so TensorRT must inline its body (trt_plugin.py).
        fused = ir.Node(DOMAIN, "AddRMSNorm", [*add.inputs, norm.inputs[1]],
                        [ir.AttrFloat32("epsilon", norm.attributes["epsilon"].value)], num_outputs=2,
                        name=f"{norm.name or y.name}.add")
        graph.insert_before(add, fused)  # the sum's other readers may come before the norm
        replace_output(y, fused.outputs[0], "add_rms_norm_y")
        replace_output(s, fused.outputs[1], "add_rms_norm_sum")
        graph.remove([norm, *([upcast] if upcast is not None else []), add], safe=True)
        computed_scale |= fused.inputs[2] is not None and fused.inputs[2].producer() is not None
        count += 1
    if computed_scale:  # a scale computed after the Add (Gemma's 1 + w, when not folded): restore the order
        graph.sort()
    if count:
        declare_domain(model)
    return count
