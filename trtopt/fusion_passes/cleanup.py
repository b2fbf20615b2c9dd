"""Rule: constant folding and dead-code removal with onnxscript's optimizer passes.

Run first so that scales, axes and perms are constants the matchers can read (the legacy exporter emits them as
Constant nodes, and computes shapes with long Shape→Gather→Unsqueeze→Concat chains), and last so that the nodes
the fusions made dead are gone. onnxscript's full ``optimize`` also runs its default rewrite rules; on a 30-layer
legacy export those take minutes (their matcher rescans the graph per node) and we fuse what we need ourselves,
so only the folding and clean-up passes run here. Functions are never inlined: a plan's trtopt bodies must stay.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import fold_constants_ir

RULE = "cleanup"
# Inputs above this many elements are not folded, so weights are never duplicated; shapes and masks are tiny.
_FOLD_INPUT_LIMIT = 1024
_FOLD_OUTPUT_LIMIT = 1 << 16


def cleanup(model: ir.Model) -> int:
    """Fold constants and drop dead nodes in place; returns how many nodes went away."""
    before = model.graph.num_nodes()
    for _ in range(2):  # a second round folds what the first round's removals exposed
        folded = fold_constants_ir(
            model,
            onnx_shape_inference=True,
            input_size_limit=_FOLD_INPUT_LIMIT,
            output_size_limit=_FOLD_OUTPUT_LIMIT,
        )
        removed = common_passes.RemoveUnusedNodesPass()(model)
        if not (folded.modified or removed.modified):
            break
    ir.passes.PassManager(
        [
            common_passes.CommonSubexpressionEliminationPass(),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedOpsetsPass(),
        ]
    )(model)
    return max(before - model.graph.num_nodes(), 0)
