"""Marking intermediate tensors as graph outputs, as `polygraphy run --onnx-outputs` does, for layer-wise checks.

The plan's per-layer probe is each PagedAttention node's attention output; the original's is the tensor that node
replaced, whose name the build recorded on the node (fusion_passes.paged_attention.SOURCE_OUTPUT_KEY). A marked
model is written to a scratch directory next to copies of its external data files, so that neither the plan nor the
export is touched and a model of any size can be marked without parsing its weights. (Copies, not hard links: onnx
refuses external data with more than one link, as a possible link attack.)
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import onnx

from trtopt.errors import BuildError, ConfigError
from trtopt.fusion_passes.paged_attention import SOURCE_OUTPUT_KEY
from trtopt.plugins import DOMAIN


@dataclasses.dataclass(frozen=True)
class LayerProbe:
    """One layer's attention output, as each side names it."""

    layer: int
    plan_name: str  # PagedAttention output 0 in the plan: [1, Hq, T, D]
    source_name: str  # the original graph's attention output it replaced ("" when the plan did not record it)


def layer_probes(plan_model: Path) -> list[LayerProbe]:
    """Every PagedAttention of a plan's model.onnx, in layer order."""
    proto = onnx.load(str(plan_model), load_external_data=False)
    probes = []
    for node in proto.graph.node:
        if node.domain != DOMAIN or node.op_type != "PagedAttention":
            continue
        found = re.search(r"(\d+)$", node.name)
        assert found, f"PagedAttention node {node.name!r} has no layer index"
        meta = {p.key: p.value for p in node.metadata_props}
        probes.append(LayerProbe(int(found.group(1)), node.output[0], meta.get(SOURCE_OUTPUT_KEY, "")))
    if not probes:
        raise BuildError(f"{plan_model} has no PagedAttention node to mark; is it a paged plan built by `trtopt build`?")
    return sorted(probes, key=lambda p: p.layer)


def check_source_names(probes: list[LayerProbe], original: Path) -> None:
    """ConfigError unless every probe names a tensor of the original graph."""
    if any(not p.source_name for p in probes):
        raise ConfigError("the plan does not record which tensor of the original each PagedAttention replaced "
                          "(built by an older trtopt); rebuild it with `trtopt build` to compare layer by layer.")
    proto = onnx.load(str(original), load_external_data=False)
    produced = {name for node in proto.graph.node for name in node.output}
    missing = [p.source_name for p in probes if p.source_name not in produced]
    if missing:
        raise ConfigError(f"the original {original} has no tensor {missing[0]!r} (the attention output that the plan's "
                          f"layer {probes[0].layer} replaced, among {len(missing)} missing); is this the export the "
                          "plan was built from?")


def marked_copy(model_path: Path, names: list[str], scratch: Path) -> Path:
    """A copy of ``model_path`` in ``scratch`` whose graph also outputs ``names``, with copies of its external data
    files and of a plan.json beside it. Returns the new model path."""
    proto = onnx.load(str(model_path), load_external_data=False)
    types = _value_types(proto)
    outputs = {o.name for o in proto.graph.output}
    for name in names:
        if name in outputs:
            continue
        elem_type = types.get(name, 0)
        assert elem_type, f"no dtype is known for {name!r} in {model_path}, even after shape inference"
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    scratch.mkdir(parents=True, exist_ok=True)
    for location in _external_files(proto) | {"plan.json"}:
        source = model_path.parent / location
        if source.is_file():
            (scratch / location).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, scratch / location)
    out = scratch / model_path.name
    onnx.save(proto, str(out))
    return out


def _value_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value the graph declares; shape inference fills the rest (legacy exports declare few)."""
    known = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info}
    if len(known) < len(proto.graph.node):
        inferred = onnx.shape_inference.infer_shapes(proto)
        known.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    return known


def _external_files(proto: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for tensor in onnx.external_data_helper._get_all_tensors(proto)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
