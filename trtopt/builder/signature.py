"""The plan graph's I/O must be exactly the paged signature (trtopt/signature.py): the runtime feeds these only."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt import signature
from trtopt.errors import BuildError


def check_signature(model: ir.Model, kind: str) -> None:
    """BuildError when a paged plan graph has other I/O than §3 (e.g. an input the runtime would not feed)."""
    if kind != "paged":
        return
    graph = model.graph
    num_layers = sum(1 for v in graph.inputs if signature.is_kv_input(v.name))
    inputs, outputs = signature.input_names(num_layers), signature.output_names(num_layers)
    got_in, got_out = [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    if got_in != inputs or got_out != outputs:
        extra = sorted(set(got_in) - set(inputs)) + sorted(set(got_out) - set(outputs))
        raise BuildError(
            f"the fused graph's I/O is not the paged signature: extra {extra}, inputs {got_in}, outputs {got_out}. "
            "The runtime only feeds docs/architecture.md §3 tensors; re-export with optimum-style I/O (trtopt export)."
        )
    by_name = {v.name: v for v in graph.inputs} | {v.name: v for v in graph.outputs}
    for spec in (*signature.STEP_INPUTS, signature.LOGITS):
        expected = ir.DataType.from_numpy(np.dtype(spec.dtype))
        got = by_name[spec.name].dtype
        assert got == expected, f"{spec.name} is {got}, expected {expected}"
