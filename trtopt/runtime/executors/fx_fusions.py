"""Fusions of the torch executor on the converted torch.fx graph (the plan's ONNX graph is not changed).

`fuse_rope` finds rotary position embeddings as exporters write them (HF `apply_rotary_pos_emb`):

    out = x * cos + concat(neg(slice(x, half:)), slice(x, :half), axis=last) * sin

and replaces the seven nodes with one call of `rope`, which runs the Triton kernel on CUDA and, everywhere else or
whenever its preconditions do not hold at run time, exactly the original ops (so CPU results are bit-for-bit those
of the unfused graph). Both operand orders of the commutative `mul`/`add` are accepted.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from trtopt.runtime.executors import onnx_ops

_MUL, _ADD = operator.mul, operator.add


def rope(x, cos, sin, *, half: int, axis: int, hi_end: int, concat_axis: int):
    """x * cos + concat(-x[half:hi_end], x[:half]) * sin along `axis` (the matched subgraph, fused)."""
    last = x.dim() - 1
    fast = (x.dim() == 4 and x.shape[-1] == 2 * half and onnx_ops._axis(axis, x.dim()) == last
            and onnx_ops._axis(concat_axis, x.dim()) == last and hi_end >= 2 * half
            and x.dtype == cos.dtype == sin.dtype and x.is_cuda)
    if fast:
        try:
            from trtopt.runtime.executors.kernels.rope import rope_triton
        except ImportError:  # no triton: the original ops below
            pass
        else:
            return rope_triton(x, cos, sin)
    lo = onnx_ops.slice_(x, [0], [half], [axis])
    hi = onnx_ops.slice_(x, [half], [hi_end], [axis])
    return x * cos + onnx_ops.concat(torch.neg(hi), lo, axis=concat_axis) * sin


def _slice_spec(node) -> tuple[torch.fx.Node, int, int, int] | None:
    """(input, start, end, axis) of a one-axis, step-1 constant slice node."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is onnx_ops.slice_):
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    x, starts, ends, axes, steps = args[:5]
    consts = (starts, ends, axes)
    if not all(isinstance(c, list) and len(c) == 1 for c in consts) or node.kwargs:
        return None
    if steps is not None and steps != [1]:
        return None
    return x, starts[0], ends[0], axes[0]


def _mul_operands(node) -> list[tuple[object, object]]:
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is _MUL):
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _match(add: torch.fx.Node) -> dict | None:
    if add.op != "call_function" or add.target is not _ADD or len(add.args) != 2:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        for x, cos in _mul_operands(m1):
            for cat, sin in _mul_operands(m2):
                if not (isinstance(cat, torch.fx.Node) and cat.target is onnx_ops.concat and len(cat.args) == 2):
                    continue
                neg, lo = cat.args
                if not (isinstance(neg, torch.fx.Node) and neg.target is torch.neg):
                    continue
                lo_spec, hi_spec = _slice_spec(lo), _slice_spec(neg.args[0])
                if lo_spec is None or hi_spec is None:
                    continue
                (lo_x, lo_start, lo_end, lo_axis), (hi_x, hi_start, hi_end, hi_axis) = lo_spec, hi_spec
                if not (lo_x is x and hi_x is x and lo_start == 0 and hi_start == lo_end > 0 and lo_axis == hi_axis):
                    continue
                return dict(x=x, cos=cos, sin=sin, half=lo_end, axis=lo_axis, hi_end=hi_end,
                            concat_axis=cat.kwargs.get("axis"), nodes=[m1, m2, cat, neg, lo, neg.args[0]])
    return None


def fuse_rope(gm: torch.fx.GraphModule) -> int:
    """Replace every matched RoPE subgraph with one `rope` call; returns how many were fused."""
    count = 0
    for add in list(gm.graph.nodes):
        found = _match(add)
        if found is None or found["concat_axis"] is None:
            continue
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_function(rope, (found["x"], found["cos"], found["sin"]),
                                           {k: found[k] for k in ("half", "axis", "hi_end", "concat_axis")})
        add.replace_all_uses_with(fused)
        gm.graph.erase_node(add)
        for node in found["nodes"]:  # the matched intermediates, where nothing else reads them
            if not node.users:
                gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
