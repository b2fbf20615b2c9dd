"""Part of the paged rewrite: graphs exported without a ``position_ids`` input get it, and the positions they
computed themselves are re-sourced from it.

optimum's Gemma-3 and BLOOM exports take no position ids: Gemma-3 computes ``cache_position =
arange(past_len, past_len + T)`` from the past key's shape (then RoPE and the mask read it), BLOOM needs none (ALiBi
reads the mask). In the paged signature every token's position is the ``position_ids`` input [1, T], and a past
length no longer exists, so each tensor that *is* those positions is replaced by ``position_ids`` flattened to [T].

Which tensors: every ``Range`` output, proven by running its subgraph (as the mask probe does) for several
(past, new) lengths with batch 1 and an all-ones attention mask, and replaced only when it equals
``arange(past, past + new)`` on every probe. Ranges that are something else (the mask's ``arange(past + new)``, an
``arange(new)``) are left alone; if they still read the past length, the rewrite refuses the graph as before.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt import signature
from trtopt.fusion_passes.ir_helpers import int64_initializer
from trtopt.fusion_passes.mask_probe import ProbeInputs, evaluate_at
from trtopt.fusion_passes.trace import NoMatch

_LENGTHS = [(0, 4), (3, 1), (5, 3), (17, 2)]  # (past, new): fresh prompt, decode, chunk, a longer past


def _is_positions(model: ir.Model, value: ir.Value, roles: ProbeInputs) -> bool:
    try:
        results = evaluate_at(model, [value], roles, _LENGTHS)
    except NoMatch:
        return False
    return all(
        got.ndim == 1 and np.array_equal(got, np.arange(past, past + new))
        for (past, new), (got,) in zip(_LENGTHS, results, strict=True)
    )


def derive_position_ids(model: ir.Model, pasts: list[ir.Value]) -> int:
    """Add the ``position_ids`` input when the graph has none and re-source proven positions from it; returns how
    many tensors were re-sourced (0 for a graph that had the input, or that never computes positions)."""
    graph = model.graph
    names = {v.name for v in graph.inputs}
    if signature.POSITION_IDS.name in names:
        return 0
    spec = signature.POSITION_IDS
    position_ids = ir.Value(name=spec.name, shape=ir.Shape(list(spec.dims)), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(position_ids)
    roles = ProbeInputs(signature.INPUT_IDS.name, spec.name, "attention_mask" if "attention_mask" in names else None,
                        tuple(pasts))
    found = [n.outputs[0] for n in graph if n.op_type == "Range" and _is_positions(model, n.outputs[0], roles)]
    if not found:
        return 0
    flat = ir.Node("", "Reshape", [position_ids, int64_initializer(graph, "derived_positions_shape", [-1])],
                   name="derived_positions")
    flat.outputs[0].name = "derived_positions"
    flat.outputs[0].shape, flat.outputs[0].type = ir.Shape(["T"]), ir.TensorType(ir.DataType.INT64)
    graph.insert_before(next(iter(graph)), flat)
    for value in found:
        # Ranges over shape values are int64; the probe compared values only, so the dtype is checked here.
        assert value.dtype in (None, ir.DataType.INT64), f"a proven position tensor {value.name} is {value.dtype}"
        ir.convenience.replace_all_uses_with(value, flat.outputs[0])
    return len(found)
