"""Writing Q/DQ into the ONNX graph in the form TensorRT's explicit quantization and ModelOpt's ONNX PTQ use.

- weight: quantized initializer -> DequantizeLinear -> MatMul's B. FP8 per output channel (axis=1 of W [K, N]);
  INT4/UINT4 blocked over K (axis=0, block_size=G, scales [K/G, N], opset >= 21).
- static activation: x -> QuantizeLinear(scale, fp8 zero point) -> DequantizeLinear -> the quantized MatMuls.
- dynamic per-token activation: scale = max(ReduceMax(Abs(x), last axis) / 448, tiny), then a blocked
  QuantizeLinear/DequantizeLinear with block_size = K over the last axis (opset >= 21; ONNX's per-tensor and
  per-axis scales must be constants of rank <= 1, blocked scales may be any tensor of x's rank).
- AWQ's x / s: folded into the producing norm's weight (Mul by a [K] constant, or LayerNormalization's scale and
  bias) when every consumer of x is a MatMul scaled by the same s; otherwise a Mul by 1/s before those MatMuls.

All edits go through one GraphEdit, which inserts new nodes before their first consumer and drops the float weights
no node reads any more.
"""

from __future__ import annotations

from collections import defaultdict

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trtopt.quantize.methods import FP8, FP8_MAX, QuantizedWeight

_TO_NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}


class GraphEdit:
    """Pending edits of one graph; ``commit`` rewrites the node list in a topological order."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.inits = {t.name: t for t in self.graph.initializer}
        self.index = {n.name: i for i, n in enumerate(self.graph.node)}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(self.graph.node):
            for name in node.input:
                self.consumers[name].append(i)
        self.producer = {out: i for i, n in enumerate(self.graph.node) for out in n.output}
        self.before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self._names: set[str] = set(self.inits) | set(self.producer) | {n.name for n in self.graph.node}

    def unique(self, name: str) -> str:
        base, i = name, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def node(self, name: str) -> onnx.NodeProto:
        return self.graph.node[self.index[name]]

    def add_initializer(self, name: str, array: np.ndarray) -> str:
        name = self.unique(name)
        tensor = numpy_helper.from_array(array, name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def insert_before(self, first_consumer: int, *nodes: onnx.NodeProto) -> None:
        self.before[first_consumer].extend(nodes)

    def float_type(self, initializer: str) -> tuple[int, type]:
        elem = self.inits[initializer].data_type
        return elem, _TO_NUMPY[elem]

    def commit(self) -> None:
        nodes = []
        for i, node in enumerate(self.graph.node):
            nodes.extend(self.before.get(i, ()))
            nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        used = {x for n in self.graph.node for x in n.input} | {o.name for o in self.graph.output}
        keep = [t for t in self.graph.initializer if t.name in used]
        del self.graph.initializer[:]
        self.graph.initializer.extend(keep)
        names = {t.name for t in keep}
        graph_inputs = [i for i in self.graph.input if i.name in names or i.name not in self.inits]
        del self.graph.input[:]
        self.graph.input.extend(graph_inputs)


def write_weight(edit: GraphEdit, matmul: str, weight: QuantizedWeight, dtype: type) -> str:
    """Replace ``matmul``'s B by DequantizeLinear(codes, scale[, zero_point]); returns the DQ node's name."""
    node = edit.node(matmul)
    base = f"{matmul}.weight"
    inputs = [edit.add_initializer(f"{base}_quantized", weight.codes),
              edit.add_initializer(f"{base}_scale", weight.scale.astype(dtype))]
    if weight.zero_point is not None:
        inputs.append(edit.add_initializer(f"{base}_zero_point", weight.zero_point))
    attrs = {"axis": 1} if weight.group is None else {"axis": 0, "block_size": weight.group}
    out = edit.unique(f"{base}_dequantized")
    dq = helper.make_node("DequantizeLinear", inputs, [out], name=edit.unique(f"{matmul}/weight_dq"), **attrs)
    edit.insert_before(edit.index[matmul], dq)
    node.input[1] = out
    return dq.name


def _rewire(edit: GraphEdit, tensor: str, matmuls: list[str], new: str) -> None:
    for name in matmuls:
        node = edit.node(name)
        node.input[0] = new
    assert all(edit.node(m).input[0] == new for m in matmuls), tensor


def _first(edit: GraphEdit, matmuls: list[str]) -> int:
    return min(edit.index[m] for m in matmuls)


def write_static_fp8(edit: GraphEdit, tensor: str, matmuls: list[str], absmax: float, dtype: type) -> float:
    """x -> Q -> DQ (per-tensor scale absmax / 448) feeding ``matmuls``; returns the scale written."""
    scale = np.asarray(max(absmax / FP8_MAX, 2.0 ** -24), dtype=dtype)
    s = edit.add_initializer(f"{tensor}_act_scale", scale)
    zp = edit.add_initializer(f"{tensor}_act_zero_point", np.zeros((), FP8))
    q, dq = edit.unique(f"{tensor}_act_quantized"), edit.unique(f"{tensor}_act_dequantized")
    edit.insert_before(_first(edit, matmuls),
                       helper.make_node("QuantizeLinear", [tensor, s, zp], [q], name=edit.unique(f"{tensor}/act_q")),
                       helper.make_node("DequantizeLinear", [q, s, zp], [dq], name=edit.unique(f"{tensor}/act_dq")))
    _rewire(edit, tensor, matmuls, dq)
    return float(scale)


def write_dynamic_fp8(edit: GraphEdit, tensor: str, matmuls: list[str], k: int, dtype: type) -> None:
    """Per-token scale max|x| / 448 over the last axis, then blocked Q/DQ (block_size=K) feeding ``matmuls``."""
    axes = edit.add_initializer(f"{tensor}_dyn_axes", np.array([-1], np.int64))
    fmax = edit.add_initializer(f"{tensor}_dyn_fp8_max", np.asarray(FP8_MAX, dtype))
    tiny = edit.add_initializer(f"{tensor}_dyn_min_scale", np.asarray(2.0 ** -24, dtype))
    t = {k_: edit.unique(f"{tensor}_dyn_{k_}") for k_ in ("abs", "amax", "ratio", "scale", "quantized", "dequantized")}
    name = lambda what: edit.unique(f"{tensor}/dyn_{what}")  # noqa: E731
    edit.insert_before(
        _first(edit, matmuls),
        helper.make_node("Abs", [tensor], [t["abs"]], name=name("abs")),
        helper.make_node("ReduceMax", [t["abs"], axes], [t["amax"]], name=name("amax"), keepdims=1),
        helper.make_node("Div", [t["amax"], fmax], [t["ratio"]], name=name("div")),
        helper.make_node("Max", [t["ratio"], tiny], [t["scale"]], name=name("scale")),
        helper.make_node("QuantizeLinear", [tensor, t["scale"]], [t["quantized"]], name=name("q"), axis=-1,
                         block_size=k, output_dtype=TensorProto.FLOAT8E4M3FN),
        helper.make_node("DequantizeLinear", [t["quantized"], t["scale"]], [t["dequantized"]], name=name("dq"),
                         axis=-1, block_size=k),
    )
    _rewire(edit, tensor, matmuls, t["dequantized"])


def write_input_scale(edit: GraphEdit, tensor: str, matmuls: list[str], scale: np.ndarray, dtype: type) -> str:
    """Make ``matmuls`` read x / s: fold 1/s into the norm that produces x when that is exact, else insert a Mul.
    Returns "folded" or "mul"."""
    producer = edit.producer.get(tensor)
    every_consumer = {edit.graph.node[i].name for i in edit.consumers[tensor]} == set(matmuls)
    inv = (1.0 / scale.astype(np.float64))
    if producer is not None and every_consumer and tensor not in {o.name for o in edit.graph.output}:
        node = edit.graph.node[producer]
        if node.op_type == "Mul":
            for slot in (0, 1):
                const = node.input[slot]
                if const in edit.inits and tuple(edit.inits[const].dims) == scale.shape:
                    gamma = numpy_helper.to_array(edit.inits[const]).astype(np.float64)
                    node.input[slot] = edit.add_initializer(f"{const}_awq", (gamma * inv).astype(dtype))
                    return "folded"
        if node.op_type == "LayerNormalization" and all(x in edit.inits for x in node.input[1:] if x):
            for slot in range(1, len(node.input)):
                if node.input[slot]:
                    const = numpy_helper.to_array(edit.inits[node.input[slot]]).astype(np.float64)
                    node.input[slot] = edit.add_initializer(f"{node.input[slot]}_awq", (const * inv).astype(dtype))
            return "folded"
    factor = edit.add_initializer(f"{tensor}_awq_inv_scale", inv.astype(dtype))
    out = edit.unique(f"{tensor}_awq_scaled")
    edit.insert_before(_first(edit, matmuls),
                       helper.make_node("Mul", [tensor, factor], [out], name=edit.unique(f"{tensor}/awq_mul")))
    _rewire(edit, tensor, matmuls, out)
    return "mul"
