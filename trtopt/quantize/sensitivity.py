"""Layer sensitivity of a quantization: the error that each decoder layer's quantized MatMuls add on their own.

For each layer, a copy of the float export gets that layer's MatMuls quantized exactly as the full quantization
quantizes them (the same codes, scales, activation Q/DQ and AWQ input scale; ``MatMulQuant``) while every other
layer stays float; it runs on onnxruntime CPU over a few text windows, and its logits are compared with the float
model's by `trtopt check`'s quantization metrics (trtopt/check/compare.py QuantStats: mean KL, top-1 agreement,
max |Δ logprob| of the float argmax). One run per layer (30 for SmolLM2-135M) plus the float and the fully quantized
runs; layers rank by mean KL (Polygraphy's precision bisect, one layer at a time, for an export with past KV).

Used by `trtopt quantize --exclude auto:N` (calibration windows, before writing the model) and by `trtopt check
FP_EXPORT QUANT_PLAN --layerwise` (held-out windows, the tensors read back from the plan's QMatMuls).
"""

from __future__ import annotations

import ast
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np
import onnx

from trtopt.quantize.methods import FP8_MAX, QuantizedWeight

if TYPE_CHECKING:
    from trtopt.check.compare import QuantStats

DEFAULT_WINDOWS = (4, 256)  # (windows, tokens): what each variant runs; ~1k tokens keep 30 layers to minutes
_LAYER = re.compile(r"(?:^|[./_])(?:layers|layer|h|blocks|block)[./_](\d+)(?:[./_]|$)")
_PROTO_LIMIT = 1_800_000_000  # bytes: a bigger variant goes to ORT as a file with external data


@dataclass(frozen=True)
class MatMulQuant:
    """How one MatMul of the float export is quantized: what goes in front of it."""

    node: str  # the float export's MatMul node name
    weight: QuantizedWeight  # what replaces its B (a weight DequantizeLinear)
    act_mode: str = "none"  # "none" | "static" (per-tensor FP8 Q/DQ) | "dynamic" (per-token FP8 Q/DQ)
    act_absmax: float | None = None  # static: the calibrated max |x| (scale = absmax / 448)
    input_scale: np.ndarray | None = None  # AWQ's s [K]: the MatMul reads x / s (its weight holds W * s)


@dataclass(frozen=True)
class LayerSensitivity:
    """The error of one layer quantized alone (everything else float)."""

    layer: str  # the decoder layer index, or the MatMul's name when its layer is not known
    matmuls: tuple[str, ...]  # module paths (node names when the export recorded none)
    nodes: tuple[str, ...]  # the MatMul node names
    stats: QuantStats  # against the float model

    def to_dict(self) -> dict:
        return {"layer": self.layer, "matmuls": list(self.matmuls), "nodes": list(self.nodes), **self.stats.to_dict()}


@dataclass(frozen=True)
class SensitivityReport:
    """Every layer's own error, most sensitive first, next to the error of everything quantized."""

    layers: tuple[LayerSensitivity, ...]
    full: QuantStats  # the whole quantization against the float model
    tokens: int  # positions compared per run

    def most_sensitive(self, n: int) -> tuple[LayerSensitivity, ...]:
        return self.layers[:n]

    def to_dict(self) -> dict:
        return {"metric": "mean KL(float || quantized) per position, nats; layers ranked by it",
                "tokens": self.tokens, "all_quantized": self.full.to_dict(),
                "layers": [{"rank": i + 1, **layer.to_dict()} for i, layer in enumerate(self.layers)]}


def module_path(node: onnx.NodeProto) -> str:
    """The module a MatMul belongs to: torch's name scope (dynamo export), else the node name as a dotted path."""
    meta = {p.key: p.value for p in node.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            names = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            names = []
        if len(names) >= 2:
            return str(names[-2])
    return node.name.strip("/").replace("/", ".")


def module_paths(model: onnx.ModelProto) -> dict[str, str]:
    """module_path of every MatMul, by node name. Read it before onnx's version converter, which drops node
    metadata."""
    return {n.name: module_path(n) for n in model.graph.node if n.op_type == "MatMul"}


def group_by_layer(paths: Mapping[str, str], nodes: Sequence[str]) -> dict[str, list[str]]:
    """Decoder layer index (as a string) -> its MatMul node names, in ``nodes`` order; a MatMul whose module path
    (``paths``, from module_paths) names no layer is a group of its own."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in nodes:
        found = _LAYER.search(paths.get(name, name))
        groups[found.group(1) if found else name].append(name)
    return dict(groups)


@dataclass(frozen=True)
class Written:
    """What apply_quant wrote, by activation tensor."""

    act_scales: dict[str, float]  # static FP8 activation scales
    placements: dict[str, str]  # AWQ's x / s: "folded" into the producing norm or a "mul" inserted


def apply_quant(model: onnx.ModelProto, specs: Sequence[MatMulQuant]) -> Written:
    """Write ``specs`` into ``model`` (in place): weight DQ, AWQ input scale, activation Q/DQ, in that order per
    activation tensor."""
    from trtopt.quantize.qdq import GraphEdit, write_dynamic_fp8, write_input_scale, write_static_fp8, write_weight

    edit = GraphEdit(model)
    by_tensor: dict[str, list[MatMulQuant]] = defaultdict(list)
    for spec in specs:
        by_tensor[edit.node(spec.node).input[0]].append(spec)
    written = Written({}, {})
    for tensor, members in by_tensor.items():
        first, names = members[0], [m.node for m in members]
        assert all(m.act_mode == first.act_mode and (m.input_scale is None) == (first.input_scale is None)
                   for m in members), f"the MatMuls reading {tensor} are quantized differently"
        _, dtype = edit.float_type(edit.node(first.node).input[1])
        for m in members:
            write_weight(edit, m.node, m.weight, dtype)
        if first.input_scale is not None:
            written.placements[tensor] = write_input_scale(edit, tensor, names, first.input_scale, dtype)
        if first.act_mode == "static":
            written.act_scales[tensor] = write_static_fp8(edit, tensor, names, first.act_absmax, dtype)
        elif first.act_mode == "dynamic":
            write_dynamic_fp8(edit, tensor, names, first.weight.codes.shape[0], dtype)
    edit.commit()
    return written


def layer_sensitivity(model: onnx.ModelProto, specs: Sequence[MatMulQuant], sequences: Sequence[Sequence[int]], *,
                      paths: Mapping[str, str], threads: int = 2,
                      on_progress: Callable[[str, int, int], None] | None = None) -> SensitivityReport:
    """Quantize one layer at a time (``specs`` grouped by ``group_by_layer(paths)``) in copies of the float ``model``
    (at an opset the Q/DQ ops need) and compare each copy's logits on ``sequences`` (each from an empty KV cache)
    with the float model's. on_progress(what, done, total) is called as the runs advance."""
    from trtopt.check.compare import QuantStats, ReferenceLogits

    layers = group_by_layer(paths, [s.node for s in specs])
    by_node = {s.node: s for s in specs}
    total, done = len(layers) + 2, 0

    def step(what: str) -> None:
        nonlocal done
        if on_progress:
            on_progress(what, done, total)
        done += 1

    step("sensitivity: the float model")
    reference = [ReferenceLogits.of(x) for x in _logits(model, sequences, threads)]

    def measure(chosen: Sequence[MatMulQuant]) -> QuantStats:
        variant = onnx.ModelProto()
        variant.CopyFrom(model)
        apply_quant(variant, chosen)
        stats = QuantStats()
        for got, ref in zip(_logits(variant, sequences, threads), reference):
            stats.add(got, ref)
        return stats

    step("sensitivity: every layer quantized")
    full = measure(specs)
    rows = []
    for key, nodes in layers.items():
        step(f"sensitivity: layer {key} alone")
        rows.append(LayerSensitivity(key, tuple(paths.get(n, n) for n in nodes), tuple(nodes),
                                     measure([by_node[n] for n in nodes])))
    if on_progress:
        on_progress("sensitivity: done", total, total)
    rows.sort(key=lambda r: (-r.stats.mean_kl, r.stats.top1_agreement))
    return SensitivityReport(tuple(rows), full, sum(len(s) for s in sequences))


def short_names(paths: Sequence[str]) -> str:
    """'q k v o gate up down' from full module paths (each one's last component, less a "_proj" suffix)."""
    return " ".join(path.rsplit(".", 1)[-1].removesuffix("_proj") for path in paths)


def _logits(model: onnx.ModelProto, sequences: Sequence[Sequence[int]], threads: int) -> list[np.ndarray]:
    """Every position's logits [L, vocab] float32 of each sequence, on ORT."""
    from trtopt.quantize.runner import OrtCausalLM
    from trtopt.signature import LOGITS

    with tempfile.TemporaryDirectory(prefix="trtopt-sensitivity-") as scratch:
        source: onnx.ModelProto | Path = model
        if model.ByteSize() > _PROTO_LIMIT:
            source = Path(scratch) / "model.onnx"
            onnx.save(model, str(source), save_as_external_data=True, location="model.onnx.data")
        lm = OrtCausalLM(source, threads=threads)
        out = []
        for seq in sequences:
            logits = lm.run(list(seq))[LOGITS.name]
            out.append(logits.reshape(-1, logits.shape[-1])[-len(seq):].astype(np.float32))
        return out


def _plan_qmatmuls(plan: onnx.ModelProto, plan_inits: dict):
    """(QMatMul node, the QMatMul it stands for, its (codes, scale, zero point)) for each QMatMul of ``plan``: a
    horizontally fused one (fusion_passes/horizontal_matmul.py) once per member, with that member's columns."""
    from onnx import numpy_helper

    from trtopt.fusion_passes.horizontal_matmul import members
    from trtopt.plugins import DOMAIN
    from trtopt.plugins.qmatmul.schema import OP_TYPE

    for node in plan.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        missing = [x for x in node.input[1:4] if x not in plan_inits]
        assert not missing, f"{node.name}: weight inputs {missing} are not initializers"
        arrays = [numpy_helper.to_array(plan_inits[x]) for x in node.input[1:4]]
        start = 0
        for member, width in members(node) or [(node.name, arrays[0].shape[-1])]:
            yield node, member, tuple(np.ascontiguousarray(a[..., start:start + width]) for a in arrays)  # N: last axis
            start += width


def specs_from_plan(plan: onnx.ModelProto, original: onnx.ModelProto) -> list[MatMulQuant]:
    """What each QMatMul of a built plan (``plan``, with its weights) does to the float ``original``'s MatMul that it
    replaced (the fusion names it ``<MatMul name>.qmatmul``, fusion_passes/qmatmul.py): its codes, scales and
    activation mode. An AWQ plan's weights hold W * s and its norms (or a Mul) feed x / s; s is found back per input
    channel by least squares against the float weight, and kept when it explains most of the difference (plain RTN
    leaves only rounding noise, which no per-row factor absorbs). ConfigError when a QMatMul has no float MatMul."""
    from onnx import numpy_helper

    from trtopt.errors import ConfigError
    from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_STATIC

    plan_inits = {t.name: t for t in plan.graph.initializer}
    inits = {t.name: t for t in original.graph.initializer}
    nodes = {n.name: n for n in original.graph.node}
    specs, floats = [], {}
    for node, member, (codes, scale, zero) in _plan_qmatmuls(plan, plan_inits):
        name = member.removesuffix(".qmatmul")
        source = nodes.get(name)
        if source is None or source.op_type != "MatMul" or source.input[1] not in inits:
            raise ConfigError(f"the plan's {node.name} replaced a MatMul {name!r} that the original does not have; "
                              "pass the float export that was quantized and built into this plan.")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        block = int(attrs.get("block_size", 0))
        zero_point = zero if codes.dtype.name == "uint4" else None  # int4/FP8 zero points are the fusion's zeros
        weight = QuantizedWeight(codes, scale.astype(np.float32), zero_point, block or None)
        mode = {ACT_STATIC: "static", ACT_DYNAMIC: "dynamic"}.get(int(attrs.get("act_mode", 0)), "none")
        absmax = None
        if mode == "static":
            absmax = float(np.float64(numpy_helper.to_array(plan_inits[node.input[4]])) * FP8_MAX)  # exact: 7 * 2^6
        specs.append(MatMulQuant(name, weight, mode, absmax))
        floats[name] = numpy_helper.to_array(inits[source.input[1]]).astype(np.float32)
    by_tensor: dict[str, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        by_tensor[nodes[spec.node].input[0]].append(i)
    for members in by_tensor.values():  # one s per activation tensor, fitted over its MatMuls' columns together
        w = np.concatenate([floats[specs[i].node] for i in members], axis=1).astype(np.float64)
        q = np.concatenate([specs[i].weight.dequantize() for i in members], axis=1).astype(np.float64)
        s = (q * w).sum(axis=1) / np.maximum((w * w).sum(axis=1), 1e-30)
        if ((q - s[:, None] * w) ** 2).sum() < 0.5 * ((q - w) ** 2).sum():
            for i in members:
                specs[i] = MatMulQuant(specs[i].node, specs[i].weight, specs[i].act_mode, specs[i].act_absmax,
                                       s.astype(np.float32))
    return specs
