"""Fusions of the torch executor on the converted torch.fx graph (the plan's ONNX graph is not changed).

Two rewrites: `fuse_rope_into_paged_attention` (plans built with the rope pass, the default) and `fuse_rope`
(older plans, or plans built with `--disable-pass rope`).

`fuse_rope` finds rotary position embeddings as exporters write them (HF `apply_rotary_pos_emb`):

    out = x * cos + concat(neg(slice(x, half:)), slice(x, :half), axis=last) * sin

and replaces the seven nodes with one call of `rope`, which runs the Triton kernel on CUDA and, everywhere else or
whenever its preconditions do not hold at run time, exactly the original ops (so CPU results are bit-for-bit those
of the unfused graph). Both operand orders of the commutative `mul`/`add` are accepted, and `half` may be a constant
(dynamo exports) or computed from x's shape as `Unsqueeze(Div(Gather(Shape(x), axis), 2))` (TorchScript exports,
where the converter cannot fold it because x has a dynamic dim).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from trtopt.runtime.executors import onnx_ops, trtopt_ops

_MUL, _ADD = operator.mul, operator.add


HALF_OF_DIM = -1  # `half` is x.shape[axis] // 2, read at run time


def replace_node(gm: torch.fx.GraphModule, node: torch.fx.Node, target, args: tuple, kwargs: dict | None = None,
                 dead: tuple[torch.fx.Node, ...] = ()) -> torch.fx.Node:
    """Put a call of target(*args, **kwargs) where `node` was (its users read the new call), erase `node`, then
    erase each of `dead` (consumers first) that nothing reads any more. Returns the new node."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args, kwargs or {})
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    for old in dead:
        if not old.users:
            gm.graph.erase_node(old)
    return new


def recompiled(gm: torch.fx.GraphModule, count: int) -> int:
    """After a rewrite pass: check and regenerate the module's code if anything changed; returns count."""
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def rope(x, cos, sin, *, half: int, axis: int, hi_end: int, concat_axis: int):
    """x * cos + concat(-x[half:hi_end], x[:half]) * sin along `axis` (the matched subgraph, fused)."""
    if half == HALF_OF_DIM:
        half = x.shape[axis] // 2  # the graph's int64 Div truncates; on a size that is the same as floor
    last = x.dim() - 1
    fast = (x.dim() == 4 and x.shape[-1] == 2 * half and onnx_ops._axis(axis, x.dim()) == last
            and onnx_ops._axis(concat_axis, x.dim()) == last and hi_end >= 2 * half
            and x.dtype == cos.dtype == sin.dtype and x.is_cuda)
    kernel = _rope_launcher() if fast else None
    if kernel is not None:
        return kernel(x, cos, sin)
    lo = onnx_ops.slice_(x, [0], [half], [axis])
    hi = onnx_ops.slice_(x, [half], [hi_end], [axis])
    return x * cos + onnx_ops.concat(torch.neg(hi), lo, axis=concat_axis) * sin


def _call(node, target, nargs: int) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
            and len(node.args) == nargs)


def _half_of_dim(node, x, axis) -> list[torch.fx.Node] | None:
    """The nodes of `Unsqueeze(Div(Gather(Shape(x), axis), 2), [0])` (x.shape[axis] / 2 as a 1-element list)."""
    if not (_call(node, onnx_ops.unsqueeze, 2) and node.args[1] == [0] and not node.kwargs):
        return None
    div = node.args[0]
    if not (_call(div, onnx_ops.div, 2) and div.args[1] == 2):
        return None
    gather = div.args[0]
    if not (_call(gather, onnx_ops.gather, 2) and gather.kwargs.get("axis", 0) == 0 and gather.args[1] == axis):
        return None
    shape = gather.args[0]
    if not (_call(shape, onnx_ops.shape, 1) and shape.args[0] is x and not shape.kwargs):
        return None
    return [node, div, gather, shape]


@functools.cache
def _rope_launcher():
    """The Triton RoPE launcher, or None without triton (the original ops run instead)."""
    try:
        from trtopt.plugins.rope.kernel import rope_triton
    except ImportError:
        return None
    return rope_triton


def _slice_spec(node) -> tuple[torch.fx.Node, object, object, int] | None:
    """(input, start, end, axis) of a one-axis, step-1 slice node; start/end are ints or the fx node giving them."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is onnx_ops.slice_):
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    x, starts, ends, axes, steps = args[:5]
    if node.kwargs or not (isinstance(axes, list) and len(axes) == 1):
        return None
    if steps is not None and steps != [1]:
        return None
    bounds = []
    for value in (starts, ends):
        if isinstance(value, list) and len(value) == 1:
            bounds.append(value[0])
        elif isinstance(value, torch.fx.Node):
            bounds.append(value)
        else:
            return None
    return x, bounds[0], bounds[1], axes[0]


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
                same_half = hi_start is lo_end or (isinstance(hi_start, int) and hi_start == lo_end)
                if not (lo_x is x and hi_x is x and lo_start == 0 and same_half and lo_axis == hi_axis
                        and isinstance(hi_end, int)):
                    continue
                nodes = [m1, m2, cat, neg, lo, neg.args[0]]
                if isinstance(lo_end, torch.fx.Node):  # TorchScript form: half computed from x's shape
                    chain = _half_of_dim(lo_end, x, lo_axis)
                    if chain is None:
                        continue
                    half, nodes = HALF_OF_DIM, nodes + chain
                elif isinstance(lo_end, int) and lo_end > 0:
                    half = lo_end
                else:
                    continue
                return dict(x=x, cos=cos, sin=sin, half=half, axis=lo_axis, hi_end=hi_end,
                            concat_axis=cat.kwargs.get("axis"), nodes=nodes)
    return None


def fuse_rope(gm: torch.fx.GraphModule) -> int:
    """Replace every matched RoPE subgraph with one `rope` call; returns how many were fused."""
    count = 0
    for add in list(gm.graph.nodes):
        found = _match(add)
        if found is None or found["concat_axis"] is None:
            continue
        # the matched intermediates are erased where nothing else reads them
        replace_node(gm, add, rope, (found["x"], found["cos"], found["sin"]),
                     {k: found[k] for k in ("half", "axis", "hi_end", "concat_axis")}, dead=tuple(found["nodes"]))
        count += 1
    return recompiled(gm, count)


def fuse_rope_into_paged_attention(gm: torch.fx.GraphModule) -> int:
    """PagedAttention(Rope(q, cos, sin), Rope(k, cos, sin), ...) → one `paged_attention_rope` call; returns how many.

    The plan keeps RoPE and attention as separate ops (trtopt.Rope has no TensorRT plugin: TensorRT fuses its body
    itself, and cannot fuse it into the PagedAttention plugin). On CUDA the fused call rotates q and k inside the
    KV-write kernel, two launches fewer per layer; elsewhere it runs the same ops as before, so CPU results are
    unchanged bit for bit. Matched only when both Rope nodes read the same cos and sin, have the same `half`, and
    feed nothing but this attention call. A plan built with --kv-cache-rotation hadamard has MatMul(·, H) between
    them (fusion_passes/kv_rotation.py), so nothing matches: correct, but without this fusion or the Q/K/V GEMV's
    RoPE + KV epilogue that builds on it (gemv.py).
    """
    count = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is trtopt_ops.paged_attention and len(node.args) >= 3):
            continue
        q_rope, k_rope = node.args[0], node.args[1]
        if not all(isinstance(r, torch.fx.Node) and r.op == "call_function" and r.target is trtopt_ops.rope
                   and len(r.args) == 3 and len(r.users) == 1 for r in (q_rope, k_rope)):
            continue
        if q_rope.args[1:] != k_rope.args[1:] or q_rope.kwargs.get("half", 0) != k_rope.kwargs.get("half", 0):
            continue
        kwargs = dict(node.kwargs, rope_cos=q_rope.args[1], rope_sin=q_rope.args[2],
                      rope_half=q_rope.kwargs.get("half", 0))
        replace_node(gm, node, trtopt_ops.paged_attention_rope, (q_rope.args[0], k_rope.args[0], *node.args[2:]),
                     kwargs, dead=(q_rope, k_rope))
        count += 1
    return recompiled(gm, count)


# Ops that pass their first argument's values through unchanged (only the shape changes): a value read through
# them is still the graph input it came from.
VIEWS = (onnx_ops.reshape, onnx_ops.unsqueeze, onnx_ops.squeeze, onnx_ops.flatten, onnx_ops.identity)


def _source_input(node, names: dict[torch.fx.Node, str]) -> str | None:
    """The graph input whose values `node` carries (through reshapes and the like), or None."""
    while isinstance(node, torch.fx.Node):
        if node.op == "placeholder":
            return names.get(node)
        if node.op != "call_function" or node.target not in VIEWS or not node.args:
            return None
        node = node.args[0]
    return None


def gather_nonnegative(gm: torch.fx.GraphModule, input_names: list[str], nonnegative: frozenset[str]) -> int:
    """Gathers whose indices are a graph input named in `nonnegative` (signature.NONNEGATIVE_INPUTS: token ids,
    positions, logits rows) → `onnx_ops.gather_nonnegative`, one index_select instead of ONNX's negative-index
    wrap (a compare, an add and a where before it: three launches per Gather on CUDA). Returns how many."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, input_names, strict=True))
    count = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is onnx_ops.gather and len(node.args) == 2):
            continue
        if _source_input(node.args[1], names) in nonnegative:
            node.target = onnx_ops.gather_nonnegative
            count += 1
    return recompiled(gm, count)
