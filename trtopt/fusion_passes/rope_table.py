"""Rule: the rotary tables a step computes from its positions → one Gather from a table built once, at build time.

Every exported RoPE model recomputes its cos/sin rows each step from ``position_ids``:

    cos = Cast(Cos(Concat(Cast(pos)·inv_freq, Cast(pos)·inv_freq)))     (and sin; 7–9 small ops)
      →  cos = Gather(cos_table, Reshape(position_ids, [-1]), axis=token_axis)

TensorRT-LLM builds the same table into its engines (the rotary cos/sin cache, ``max_positions × rotary_dim``) and
vLLM keeps it as ``cos_sin_cache``. This pass finds the values read as ``cos``/``sin`` by the ``trtopt.Rope`` ops
(so it runs after the rope pass; the torch executor folds those into the paged-attention call) and proves, instead
of pattern-matching the exporters' forms (Llama-3 scaling, Gemma-3's two tables, dynamo's MatMul or Mul), that each
is a function of each token's own position:

- the value's subgraph reads no graph input but ``position_ids`` (and constants), except ``input_ids`` for its
  shape only (torch 2.11's dynamo export expands ``inv_freq`` to the batch size, ``Shape(input_ids)[0]``);
- evaluated on ORT for positions ``0..max_positions−1`` it gives the table, whose token axis is the one that has
  ``max_positions`` entries there and ``k`` for a k-token probe; and for probes of scattered positions (the last
  one, 0, a middle one; one token alone) every row equals the table's row of its position, bit for bit.

The table is the value's own dtype. A bf16 plan's table is computed in float32 and rounded once to bf16
(round-to-nearest-even, what the plan's Cast does), which is exact only if nothing after the Cast to bf16 does
arithmetic: that is checked (only layout ops may read a bf16 value in the subgraph), else the value is left alone.
Tables above ``MAX_TABLE_BYTES`` are left alone too (a 128K-context model would carry 64+ MiB per table).

Positions are below the plan's ``max_model_len`` in every step the runtime feeds (the input processor caps prompt +
max_tokens, speculative lookahead stays inside max_tokens, graph padding rows use position 0), so the build sizes
the table by it. A value left alone is recorded in the trace for ``--explain``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from trtopt import signature
from trtopt.fusion_passes.ir_helpers import int64_initializer
from trtopt.fusion_passes.mask_probe import content_read, evaluate_feeds, slice_nodes
from trtopt.fusion_passes.ops import DOMAIN
from trtopt.fusion_passes.trace import NoMatch, Trace

RULE = "rope_table"
MAX_TABLE_BYTES = 64 << 20
# Ops that move or copy elements without arithmetic: a bf16 value may pass through them unchanged.
_LAYOUT = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Flatten", "Transpose", "Expand", "Identity", "Concat",
                     "Slice", "Gather", "Split", "Tile"})


def _rope_tables(graph: ir.Graph) -> list[ir.Value]:
    """The distinct computed values the trtopt.Rope ops read as cos and sin, in graph order."""
    seen: dict[int, ir.Value] = {}
    for node in graph:
        if node.domain == DOMAIN and node.op_type == "Rope":
            for value in node.inputs[1:3]:
                if value is not None and value.producer() is not None:
                    seen.setdefault(id(value), value)
    return list(seen.values())


def _rounds_once_to_bf16(nodes: list[ir.Node], target: ir.Value) -> bool:
    """Whether the target is bf16, after checking that evaluating the subgraph in float32 and rounding the result
    once gives the plan's values: every bf16 value must come from a Cast to bf16 (or a bf16 constant, exact in
    float32) and reach the target through layout ops only; NoMatch otherwise."""
    bf16 = ir.DataType.BFLOAT16
    half: set[int] = set()
    for node in nodes:
        reads_half = any(v is not None and (id(v) in half or (v.const_value is not None and v.dtype == bf16))
                         for v in node.inputs)
        to = node.attributes.get("to")
        if node.op_type == "Cast" and to is not None and to.value == bf16:
            if reads_half:
                raise NoMatch("a Cast to bf16 reads a bf16 value", node.name or "")
            half.update(id(o) for o in node.outputs)
        elif reads_half:
            if node.op_type not in _LAYOUT:
                raise NoMatch(f"{node.op_type} computes on a bf16 value: a float32 table rounded once would not "
                              "equal it", node.name or "")
            half.update(id(o) for o in node.outputs)
    return id(target) in half


def _table(model: ir.Model, value: ir.Value, positions: ir.Value, max_positions: int) -> tuple[np.ndarray, int]:
    """(table, token axis) of ``value``, proven as the module docstring says; NoMatch otherwise."""
    nodes, inputs, _ = slice_nodes(model.graph, [value])
    content = content_read(nodes, [value])
    # input_ids may be read for its shape (exports expand inv_freq to the batch size, Shape(input_ids)[0]); the
    # runtime's is [1, T] like position_ids, so the probes feed zeros of that shape.
    others = sorted(v.name for v in inputs if v is not positions
                    and (v.name != signature.INPUT_IDS.name or id(v) in content))
    if others or positions not in inputs:
        raise NoMatch(f"it reads {', '.join(others) or 'no position_ids'}, not only position_ids",
                      value.producer().name or "")
    is_bf16 = _rounds_once_to_bf16(nodes, value)
    probes = [np.arange(max_positions, dtype=np.int64)[None],
              np.array([[max_positions - 1, 0, max_positions // 2]], dtype=np.int64),
              np.array([[max_positions // 3]], dtype=np.int64)]
    feeds = [{positions.name: p, signature.INPUT_IDS.name: np.zeros_like(p)} for p in probes]
    results = [r for (r,) in evaluate_feeds(model, [value], feeds)]
    full = results[0]
    axes = [a for a in range(full.ndim) if full.shape[a] == max_positions and results[1].ndim == full.ndim
            and results[1].shape[a] == 3 and results[2].shape[a] == 1]
    if len(axes) != 1 or any(r.ndim != full.ndim for r in results):
        raise NoMatch(f"no one token axis in its shapes {[r.shape for r in results]}", value.producer().name or "")
    axis = axes[0]
    for probe, got in zip(probes[1:], results[1:], strict=True):
        want = np.take(full, probe[0], axis=axis)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise NoMatch("its rows are not a function of each token's position alone", value.producer().name or "")
    if is_bf16:
        full = full.astype(np.float32).astype(ml_dtypes.bfloat16)  # round to nearest even, as the plan's Cast
    elif value.dtype is not None and full.dtype != value.dtype.numpy():
        raise NoMatch(f"ORT computed {full.dtype}, the plan has {value.dtype}", value.producer().name or "")
    if full.nbytes > MAX_TABLE_BYTES:
        raise NoMatch(f"its table for {max_positions} positions would take {full.nbytes:,} bytes "
                      f"(> {MAX_TABLE_BYTES:,})", value.producer().name or "")
    return np.ascontiguousarray(full), axis


def tabulate_rope(model: ir.Model, trace: Trace | None = None, *, max_positions: int) -> int:
    """Replace every proven rotary table computation by a Gather from its table; returns how many."""
    graph = model.graph
    positions = next((v for v in graph.inputs if v.name == signature.POSITION_IDS.name), None)
    if positions is None or max_positions < 4:
        return 0
    flat = None
    count = 0
    for value in _rope_tables(graph):
        try:
            table, axis = _table(model, value, positions, max_positions)
        except NoMatch as e:
            if trace is not None:
                trace.fail(RULE, value.producer().name or value.name, e)
            continue
        if flat is None:
            flat = ir.Node("", "Reshape", [positions, int64_initializer(graph, "rope_table.positions_shape", [-1])],
                           name="rope_table.positions")
            flat.outputs[0].name = "rope_table.positions"
            flat.outputs[0].shape, flat.outputs[0].type = ir.Shape(["T"]), ir.TensorType(ir.DataType.INT64)
            graph.insert_before(next(iter(graph)), flat)
        name = f"{value.name}.table"
        init = ir.Value(name=name, const_value=ir.tensor(table, name=name))
        init.shape, init.type = ir.Shape(table.shape), ir.TensorType(ir.DataType.from_numpy(table.dtype))
        graph.register_initializer(init)
        gather = ir.Node("", "Gather", [init, flat.outputs[0]], [ir.AttrInt64("axis", axis)], name=f"{name}.gather")
        out = gather.outputs[0]
        out.name, out.type = f"{value.name}.gathered", init.type
        out.shape = ir.Shape([d if a != axis else "T" for a, d in enumerate(table.shape)])
        graph.insert_after(flat, gather)
        ir.convenience.replace_all_uses_with(value, out)
        count += 1
    return count
