"""Reading the source model safely: is it ONNX at all, and does its external data stay inside its directory?"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from trtopt.builder.plan import MODEL_FILE
from trtopt.errors import BuildError


def resolve_model_path(path: Path) -> Path:
    """A .onnx file, or a directory holding model.onnx."""
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise BuildError(
            f"{path} does not exist; pass an exported .onnx file or a directory holding {MODEL_FILE} "
            "(create one with `trtopt export`)."
        )
    return path


def _external_locations(model: onnx.ModelProto) -> list[tuple[str, dict[str, str]]]:
    found = []
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            found.append((tensor.name, info))
    return found


def check_external_data(model: onnx.ModelProto, model_dir: Path) -> None:
    """BuildError for external data outside ``model_dir``, missing, or shorter than the tensors it should hold."""
    root = model_dir.resolve()
    sizes: dict[Path, int] = {}
    for name, info in _external_locations(model):
        location = info.get("location", "")
        target = (model_dir / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(root):
            raise BuildError(
                f"tensor {name!r} points its external data at {location!r}, outside the model directory {root}; "
                "refusing to read it. Move the data file next to the model and re-save with a relative location."
            )
        if not target.is_file():
            raise BuildError(f"tensor {name!r} needs the external data file {target}, which is missing.")
        size = sizes.setdefault(target, target.stat().st_size)
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > size:
            raise BuildError(
                f"the external data file {target} is truncated ({size} bytes, tensor {name!r} needs "
                f"{end}); re-export the model."
            )


def _read_graph_proto(path: Path, next_step: str) -> onnx.ModelProto:
    """The model proto without its external data; BuildError (saying ``next_step``) when it cannot be parsed."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as e:
        raise BuildError(
            f"{path} is not a readable ONNX model ({type(e).__name__}: {str(e)[:200]}); {next_step}."
        ) from e


def check_plan_model(path: Path) -> None:
    """BuildError unless a plan's model file parses and its external data stays inside the plan dir, is present
    and long enough. Every executor loads the plan through this check first, so a tampered or half-copied plan
    dir is one clear error rather than a traceback from whichever loader reads it.
    """
    if not path.is_file():
        raise BuildError(f"{path.parent} has no {path.name}; build the plan with `trtopt build`.")
    proto = _read_graph_proto(path, "rebuild the plan with `trtopt build`")
    check_external_data(proto, path.parent)


def load_source(path: Path) -> ir.Model:
    """Load the source model as onnx-ir, refusing non-ONNX, corrupt and unsafe files with a BuildError."""
    proto = _read_graph_proto(path, "check the path, or re-export it with `trtopt export`")
    # protobuf parses many non-ONNX byte strings into an almost empty message; a model has nodes and an opset.
    if not proto.graph.node or not proto.opset_import or not proto.graph.output:
        raise BuildError(
            f"{path} is not an ONNX model (no graph nodes, outputs or opset); "
            "check the path, or re-export it with `trtopt export`."
        )
    if any(node.domain == "trtopt" for node in proto.graph.node):
        raise BuildError(f"{path} is already a trtopt plan graph; build from the exported model (`trtopt export`).")
    check_external_data(proto, path.parent)
    del proto
    try:
        return ir.load(str(path))
    except Exception as e:  # onnx-ir raises several types for a corrupt graph
        raise BuildError(f"{path} is a corrupt ONNX model ({type(e).__name__}: {str(e)[:200]}); re-export it.") from e
