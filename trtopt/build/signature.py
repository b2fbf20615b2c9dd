"""The plan graph's I/O must be exactly the paged signature of DESIGN.md §3: the runtime feeds these names only."""

from __future__ import annotations

import onnx_ir as ir

from trtopt.errors import BuildError

_STEP_INPUTS = {
    "block_tables": ir.DataType.INT32,
    "seq_lens": ir.DataType.INT32,
    "query_start_loc": ir.DataType.INT32,
    "slot_mapping": ir.DataType.INT64,
    "logits_indices": ir.DataType.INT64,
}


def paged_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """The §3 input and output names, in order, for a model of ``num_layers`` layers."""
    inputs = ["input_ids", "position_ids", *(f"kv_cache.{i}" for i in range(num_layers)), *_STEP_INPUTS]
    outputs = ["logits", *(f"kv_cache_out.{i}" for i in range(num_layers))]
    return inputs, outputs


def check_signature(model: ir.Model, kind: str) -> None:
    """BuildError when a paged plan graph has other I/O than §3 (e.g. an input the runtime would not feed)."""
    if kind != "paged":
        return
    graph = model.graph
    num_layers = sum(1 for v in graph.inputs if v.name.startswith("kv_cache."))
    inputs, outputs = paged_io_names(num_layers)
    got_in, got_out = [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    if got_in != inputs or got_out != outputs:
        extra = sorted(set(got_in) - set(inputs)) + sorted(set(got_out) - set(outputs))
        raise BuildError(
            f"the fused graph's I/O is not the paged signature: extra {extra}, inputs {got_in}, outputs {got_out}. "
            "The runtime only feeds DESIGN.md §3 tensors; re-export with optimum-style I/O (trtopt export)."
        )
    for value in graph.inputs:
        expected = _STEP_INPUTS.get(value.name, ir.DataType.INT64 if value.name.endswith("_ids") else None)
        assert expected is None or value.dtype == expected, f"{value.name} is {value.dtype}, expected {expected}"
    logits = graph.outputs[0]
    assert logits.dtype == ir.DataType.FLOAT, f"logits are {logits.dtype}, expected float32"
