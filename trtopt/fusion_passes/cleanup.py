"""Rule: constant folding and dead-code removal with onnxscript's optimizer.

Run first so that scales, axes and perms are constants the matchers can read (the legacy exporter emits them as
Constant nodes), and last so that the nodes the fusions made dead are gone.
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import RemoveUnusedNodesPass

RULE = "cleanup"


def cleanup(model: ir.Model) -> int:
    """Fold constants and drop dead nodes in place; returns how many nodes went away."""
    before = model.graph.num_nodes()
    # input_size_limit bounds which initializers get folded, so big weights are never duplicated.
    onnxscript.optimizer.optimize(model, num_iterations=2, input_size_limit=1024, output_size_limit=1 << 16)
    RemoveUnusedNodesPass()(model)
    return max(before - model.graph.num_nodes(), 0)
