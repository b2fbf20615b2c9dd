"""The exported graph as the quantizer sees it: loading it safely, finding the MatMuls with constant weights, lifting
the opset, and writing the quantized model directory."""

from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from trtopt.errors import BuildError, QuantizeError

MODEL_FILE = "model.onnx"
DATA_FILE = MODEL_FILE + ".data"
_PROTO_LIMIT = 1_800_000_000  # bytes: above this the model is saved with external data (protobuf's 2 GB cap)
_QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulNBits",
                            "MatMulInteger", "QLinearMatMul", "MatMulFpQ4", "GatherBlockQuantized"})
# ops that keep the LM head's output the logits (walking back from the graph output to the head's MatMul)
_PASS_THROUGH = frozenset({"Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Slice", "Gather", "Flatten",
                           "Mul", "Div", "Tanh", "Add"})


@dataclass(frozen=True)
class MatMulTarget:
    """One MatMul whose B input is a constant [K, N] float weight (y = x @ W)."""

    node: str  # MatMul node name
    weight: str  # initializer name of W
    activation: str  # the MatMul's A input
    k: int
    n: int


@dataclass(frozen=True)
class Targets:
    """What the quantizer will touch, and what it leaves alone with the reason (``--exclude`` and the LM head)."""

    quantize: tuple[MatMulTarget, ...]
    skipped: dict[str, str]  # node name -> why it stays high precision
    lm_head: str | None


def resolve_model_path(path: Path) -> Path:
    """A .onnx file, or a directory holding model.onnx."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise QuantizeError(f"{path} does not exist; pass an exported .onnx file or a directory holding "
                            f"{MODEL_FILE} (create one with `trtopt export`).")
    return path


def load_model(path: Path) -> onnx.ModelProto:
    """The model with its weights; QuantizeError for a non-ONNX, unsafe, plan-graph or already quantized file."""
    from trtopt.builder.source import check_external_data

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as e:
        raise QuantizeError(f"{path} is not a readable ONNX model ({type(e).__name__}); pass the directory "
                            "`trtopt export` wrote.") from e
    # protobuf parses many non-ONNX byte strings into an almost empty message; a model has nodes and an opset.
    if not proto.graph.node or not proto.opset_import or not proto.graph.output:
        raise QuantizeError(f"{path} is not an ONNX model (no graph nodes, outputs or opset); pass the directory "
                            "`trtopt export` wrote.")
    if any(n.domain == "trtopt" for n in proto.graph.node):
        raise QuantizeError(f"{path} is a trtopt plan graph; quantize the export (`trtopt export` output), then "
                            "build the plan from the quantized model.")
    done = sorted({n.op_type for n in proto.graph.node if n.op_type in _QUANTIZED_OPS})
    if done:
        raise QuantizeError(f"{path} is already quantized (it has {', '.join(done)} nodes); quantize the float "
                            "export instead.")
    try:
        check_external_data(proto, path.parent)
    except BuildError as e:
        raise QuantizeError(str(e)) from e
    onnx.load_external_data_for_model(proto, str(path.parent))
    for i, node in enumerate(proto.graph.node):  # names key every edit; exporters name nodes, hand-made graphs may not
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    return proto


def opset_of(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


DETACH_MIN_BYTES = 1024  # initializers at least this large leave the proto while the version converter runs
_DETACHED = "trtopt-detached"  # the placeholder location they carry meanwhile (never read)


def _detach_weights(model: onnx.ModelProto) -> dict[str, bytes]:
    """Move the raw bytes of the graph's large initializers out of ``model`` (each marked as external data at a
    placeholder location) and return them by name: the version converter serializes the whole proto, which protobuf
    refuses past 2 GiB (any export of more than ~1B bf16 parameters)."""
    stash = {}
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and len(init.raw_data) >= DETACH_MIN_BYTES:
            stash[init.name] = init.raw_data
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.EXTERNAL
            init.external_data.add(key="location", value=_DETACHED)
    return stash


def _attach_weights(model: onnx.ModelProto, stash: dict[str, bytes]) -> None:
    """Undo `_detach_weights` on ``model`` (the converter keeps initializer names)."""
    for init in model.graph.initializer:
        if init.name in stash and any(e.value == _DETACHED for e in init.external_data):
            del init.external_data[:]
            init.data_location = onnx.TensorProto.DEFAULT
            init.raw_data = stash[init.name]


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The model at ``opset`` (unchanged when already there); QuantizeError when the converter fails. The large
    weights are kept out of the proto the converter serializes (`_detach_weights`), so models past 2 GiB convert."""
    if opset_of(model) >= opset:
        return model
    from onnx import version_converter

    stash = _detach_weights(model)
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as e:  # the converter raises RuntimeError/ConvertError with a long C++ message
        raise QuantizeError(f"cannot lift the model from opset {opset_of(model)} to {opset}, which the quantized "
                            f"ops need ({str(e).splitlines()[0][:200]}); re-export with `trtopt export --opset "
                            f"{opset}`.") from e
    finally:
        _attach_weights(model, stash)
    _attach_weights(converted, stash)
    return converted


def _lm_head(model: onnx.ModelProto, weights: dict[str, onnx.TensorProto]) -> str | None:
    """The MatMul that produces the logits: walk back from the first graph output through reshapes and casts."""
    producer = {out: node for node in model.graph.node for out in node.output}
    tensor = model.graph.output[0].name
    for _ in range(8):
        node = producer.get(tensor)
        if node is None:
            return None
        if node.op_type == "MatMul":
            return node.name if node.input[1] in weights else None
        if node.op_type not in _PASS_THROUGH:
            return None
        tensor = next((x for x in node.input if x and x not in weights), None)
    return None


def find_targets(model: onnx.ModelProto, *, exclude: tuple[str, ...] = ()) -> Targets:
    """Every MatMul with a constant 2-D float weight, less the LM head and the ``exclude`` fnmatch patterns (over
    node and weight names). Embeddings are Gathers and are never touched."""
    weights = {t.name: t for t in model.graph.initializer}
    lm_head = _lm_head(model, weights)
    chosen, skipped = [], {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            continue
        w = weights[node.input[1]]
        if len(w.dims) != 2 or w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                   onnx.TensorProto.BFLOAT16):
            skipped[node.name] = f"weight {w.name} is not a 2-D float tensor"
            continue
        if node.name == lm_head:
            skipped[node.name] = "LM head (kept high precision)"
            continue
        pattern = next((p for p in exclude if fnmatch.fnmatchcase(node.name, p)
                        or fnmatch.fnmatchcase(w.name, p)), None)
        if pattern is not None:
            skipped[node.name] = f"--exclude {pattern}"
            continue
        chosen.append(MatMulTarget(node.name, w.name, node.input[0], int(w.dims[0]), int(w.dims[1])))
    if not chosen:
        raise QuantizeError("the graph has no MatMul with a constant weight left to quantize "
                            f"({len(skipped)} skipped: {', '.join(sorted(set(skipped.values()))) or 'none found'}); "
                            "pass a transformer export from `trtopt export`, or loosen --exclude.")
    return Targets(tuple(chosen), skipped, lm_head)


def weight_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return numpy_helper.to_array(tensor)


def save_model_dir(model: onnx.ModelProto, source: Path, out_dir: Path) -> Path:
    """Write ``out_dir/model.onnx`` (external data above protobuf's limit) and copy the source's config and
    tokenizer files next to it; returns the model path."""
    from trtopt.export.exporter import AUX_FILES

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MODEL_FILE
    big = model.ByteSize() > _PROTO_LIMIT
    onnx.save(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True, location=DATA_FILE,
              size_threshold=1024)
    for name in AUX_FILES:
        if (source.parent / name).is_file():
            shutil.copy2(source.parent / name, out_dir / name)
    return path
