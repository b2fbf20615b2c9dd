"""Writing a plan dir's files: the ONNX graph (weights beside it when large, then the full ONNX checker) and the
tokenizer and config files copied from next to the source model (docs/architecture.md §1).

Every writer of a plan graph uses ``save_model``: the build (pipeline.py), the rank plans of a sharded build
(sharding/writer.py) and the self-draft plan (draft.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from trtopt.builder.plan import MODEL_FILE
from trtopt.errors import BuildError

# Files copied from next to the source model so the plan dir is self-contained for the runtime and detokenizer.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
EXTERNAL_DATA_FILE = "model.onnx.data"
# Above this many weight bytes the plan's weights go to model.onnx.data (protobuf cannot hold 2 GiB).
EXTERNAL_DATA_THRESHOLD = 256 << 20


def save_model(proto: onnx.ModelProto, out_dir: Path) -> Path:
    """Write ``proto`` as out_dir/model.onnx (its weights to model.onnx.data above EXTERNAL_DATA_THRESHOLD; onnx
    then moves them out of ``proto`` in place) and run the full ONNX checker on the file; BuildError if it fails."""
    path = out_dir / MODEL_FILE
    weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
    if weight_bytes > EXTERNAL_DATA_THRESHOLD:
        onnx.save(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=EXTERNAL_DATA_FILE,
            size_threshold=1024,
        )
        (out_dir / EXTERNAL_DATA_FILE).chmod(0o644)  # onnx writes it 0600; servers often run as another user
    else:
        onnx.save(proto, path)
    # The full checker (with shape inference of the function bodies) reads the saved file, so 2 GiB models work.
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise BuildError(f"the fused graph failed the ONNX checker: {str(e)[:800]}. Please report this build.") from e
    return path


def copy_side_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy the SIDE_FILES present in ``source_dir`` to ``out_dir``; returns the names copied."""
    copied = []
    for name in SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out_dir / name)
            copied.append(name)
    return copied
