"""Graph passes that turn an exported ONNX graph into the plan graph (docs/architecture.md §2-3).

One rule per file; ``pipeline.optimize`` holds the single ordered pass list and returns the counts.
"""

from trtopt.fusion_passes.pipeline import FusionReport, optimize

__all__ = ["FusionReport", "optimize"]
