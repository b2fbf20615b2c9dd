"""Can onnx2torch convert what the torch executor runs? (the measurement behind architecture.md §5's choice)

Tries ``onnx2torch.convert`` on each given model (an export dir's model.onnx, a plan dir's fused model.onnx) and
prints, per model, either "converted" (and whether the module runs on the graph's own example inputs is not
checked: conversion is the first gate) or the exception onnx2torch raised. onnx2torch is not a trtopt dependency;
install it somewhere throwaway:

    pip install --no-deps --target /tmp/o2t onnx2torch
    PYTHONPATH=/tmp/o2t python benchmarks/onnx2torch_check.py EXPORT_OR_PLAN_DIR [...]

The recorded result is docs/benchmarks/onnx2torch.txt.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import onnx


def try_convert(model_dir: Path) -> str:
    import onnx2torch

    model = onnx.load(str(model_dir / "model.onnx"))
    ops = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node})
    try:
        onnx2torch.convert(model)
    except Exception as e:  # whatever onnx2torch raises is the finding
        return f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:200]}  ({len(ops)} op types)"
    return f"converted ({len(ops)} op types)"


def _without_torchvision() -> None:
    """onnx2torch imports torchvision for its NMS and RoIAlign converters only; no LLM graph has those ops, and
    torchvision must match the installed torch exactly. Where it is missing, stand in a module that fails if used."""
    import importlib.util
    import types

    if importlib.util.find_spec("torchvision") is not None:
        return

    def unavailable(*_, **__):
        raise RuntimeError("torchvision is not installed (only NMS/RoIAlign need it)")

    ops = types.SimpleNamespace(nms=unavailable, box_convert=unavailable, roi_align=unavailable)
    vision = types.ModuleType("torchvision")
    vision.ops = ops
    ops_module = types.ModuleType("torchvision.ops")
    ops_module.roi_align = unavailable
    sys.modules.update({"torchvision": vision, "torchvision.ops": ops_module})


def main(dirs: list[str]) -> None:
    _without_torchvision()
    import onnx2torch

    print(f"onnx2torch {importlib.metadata.version('onnx2torch')}, onnx {onnx.__version__}")
    for d in dirs:
        kind = "plan" if (Path(d) / "plan.json").is_file() else "export"
        print(f"{kind} {Path(d).name}: {try_convert(Path(d))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
