"""Rule: DequantizeLinear(constant weight) → MatMul, with an optional FP8 QuantizeLinear → DequantizeLinear on the
activation, → trtopt.QMatMul (one per projection; body: the same Q/DQ ops, see plugins/qmatmul/function.py).

Forms read (any producer: trtopt quantize, ModelOpt, ORT's MatMulNBitsQuantizer in QDQ mode):

    weight      FP8 E4M3 [K, N], DequantizeLinear(axis=1), scale [N]                  (per output channel)
                (ModelOpt: a constant fp32 [K, N] through QuantizeLinear(axis=1) first, folded into the codes)
                INT4/UINT4 [K, N], DequantizeLinear(axis=0, block_size=G), scale [K/G, N], optional zero point
    activation  none | Q/DQ FP8 with a constant per-tensor scale (static)
                     | blocked Q/DQ FP8, axis=-1, block_size=K, with a computed [..., 1] scale (dynamic per token)

Anything else stays as plain ONNX ops, with the reason in the trace (``trtopt build --explain``): a weight that is
not a constant, a per-tensor or int8 weight, an activation Q/DQ in another form (the weight is still fused then,
with the activation's DequantizeLinear left in front of it). A scale that is zero or not finite (or a negative
activation scale), or a block size that does not divide K, is a broken quantization: FusionError. Negative weight
scales are fused: valid ONNX, and what ORT's symmetric 4-bit quantizer writes.

ORT's default form, com.microsoft.MatMulNBits (B packed uint4 [N, K/G, G/2] low nibble first, scales [N, K/G],
zero points packed two blocks a byte, 8 when absent), is repacked into the same QMatMul (w_q uint4 [K, N], scale and
zero point [K/G, N]) when it is 4-bit with G dividing K, fp32 accumulation (accuracy_level 0 or 1), and no g_idx or
bias, in a model of opset >= 21; otherwise it stays (ORT runs it; the torch executor cannot) with the reason.

Run before horizontal_matmul and matmul_add. horizontal_matmul concatenates the QMatMuls of one x with one
quantization (Q/K/V, gate/up) into one QMatMul + Split; matmul_add reads MatMuls only, so a bias after a quantized
projection stays an Add. `is_quantized_projection` is what those rules and the tensor-parallel sharding
(builder/sharding/analysis.py) take for a quantized projection.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import onnx_ir as ir

from trtopt.errors import FusionError
from trtopt.fusion_passes.ir_helpers import is_op
from trtopt.fusion_passes.ops import DOMAIN, declare_domain, replace_output, replace_value
from trtopt.fusion_passes.trace import NoMatch, Trace
from trtopt.plugins.qmatmul.function import BLOCKED_OPSET, MIN_OPSET
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC, INPUTS, OP_TYPE

RULE = "qmatmul"
_WEIGHT_DTYPES = {ir.DataType.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn, ir.DataType.INT4: ml_dtypes.int4,
                  ir.DataType.UINT4: ml_dtypes.uint4}


@dataclasses.dataclass(frozen=True)
class _Weight:
    """The weight side of one match."""

    dq: ir.Node | None  # the weight's DequantizeLinear (None for a repacked MatMulNBits)
    codes: ir.Value  # [K, N]
    scale: ir.Value
    zero_point: ir.Value | None
    axis: int
    block_size: int


@dataclasses.dataclass(frozen=True)
class _Activation:
    """The activation side of one match: what QMatMul reads as x, and the Q/DQ it absorbs."""

    x: ir.Value
    mode: int
    scale: ir.Value | None = None
    zero_point: ir.Value | None = None
    nodes: tuple[ir.Node, ...] = ()  # the Q and DQ (removed when nothing else reads them)


# QMatMul's inputs by position (plugins/qmatmul/schema.py INPUTS).
X, W_Q, W_SCALE, W_ZERO_POINT, ACT_SCALE, ACT_ZERO_POINT = range(6)


def is_quantized_projection(node: ir.Node | None) -> bool:
    """A trtopt.QMatMul x @ W whose weight codes ([K, N]), scale and zero point are constants: what this rule makes,
    and what horizontal_matmul and the tensor-parallel sharding split or join along N and K."""
    if node is None or node.domain != DOMAIN or node.op_type != OP_TYPE or len(node.inputs) != len(INPUTS):
        return False
    consts = [node.inputs[i] for i in (W_Q, W_SCALE, W_ZERO_POINT)]
    return (node.inputs[X] is not None and all(v is not None and v.const_value is not None for v in consts)
            and len(consts[0].const_value.shape) == 2)


def _attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _check_scale(node: ir.Node, scale: np.ndarray, *, negative_ok: bool) -> None:
    """FusionError for a scale that no quantizer writes on purpose. Negative weight scales are valid ONNX and ORT's
    symmetric 4-bit quantizer writes them (it maps the signed extreme to -8); activation scales come from a max."""
    bad = ~np.isfinite(scale) | (scale == 0) | (False if negative_ok else scale < 0)
    if np.any(bad):
        kind = "zero or not finite" if negative_ok else "zero, negative or not finite"
        raise FusionError(f"{node.name}: a quantization scale is {kind} ({float(scale[bad].flat[0]):g}); the Q/DQ "
                          "graph is broken, re-quantize the model.")


def _weight(matmul: ir.Node) -> _Weight:
    dq = matmul.inputs[1].producer() if matmul.inputs[1] is not None else None
    if not is_op(dq, "DequantizeLinear"):
        raise NoMatch("the weight is not a DequantizeLinear output")
    codes, scale = dq.inputs[0], dq.inputs[1]
    zero_point = dq.inputs[2] if len(dq.inputs) > 2 else None
    if codes.const_value is None or scale.const_value is None or (zero_point is not None
                                                                   and zero_point.const_value is None):
        raise NoMatch("the quantized weight, its scale or zero point is not a constant", dq.name or "")
    if codes.dtype not in _WEIGHT_DTYPES:
        raise NoMatch(f"weight dtype {codes.dtype.name} is not FP8 E4M3, INT4 or UINT4", dq.name or "")
    shape = tuple(codes.const_value.shape)
    if len(shape) != 2:
        raise NoMatch(f"quantized weight {shape} is not 2-D [K, N]", dq.name or "")
    k, n = shape
    axis, block = _attr(dq, "axis", 1), _attr(dq, "block_size", 0)
    axis = axis + 2 if axis < 0 else axis
    s = scale.const_value.numpy()
    is_fp8 = codes.dtype == ir.DataType.FLOAT8E4M3FN
    if is_fp8 and not (axis == 1 and block == 0 and s.shape == (n,)):
        raise NoMatch(f"FP8 weight scale {s.shape} on axis {axis} (block_size {block}): only per output channel "
                      "(axis=1, scale [N]) is fused", dq.name or "")
    if not is_fp8:
        if axis != 0 or block <= 0:
            raise NoMatch(f"INT4 weight scale {s.shape} on axis {axis} (block_size {block}): only blocked over K "
                          "(axis=0, block_size=G) is fused", dq.name or "")
        if k % block:
            raise FusionError(f"{dq.name}: block_size {block} does not divide K={k}; re-quantize with a group "
                              "size that divides the input width.")
        if s.shape != (k // block, n):
            raise NoMatch(f"INT4 scale {s.shape} is not [K/G, N] = {(k // block, n)}", dq.name or "")
    _check_scale(dq, s, negative_ok=True)
    if zero_point is not None and (zero_point.dtype != codes.dtype or tuple(zero_point.const_value.shape) != s.shape):
        raise NoMatch(f"zero point {zero_point.dtype.name}{tuple(zero_point.const_value.shape)} does not match "
                      f"the weight's dtype and scale shape", dq.name or "")
    if is_fp8 and zero_point is not None and np.any(zero_point.const_value.numpy().astype(np.float32) != 0):
        raise NoMatch("FP8 zero point is not zero", dq.name or "")
    if matmul.inputs[0] is not None and matmul.inputs[0].dtype not in (None, scale.dtype):
        raise NoMatch(f"activation dtype {matmul.inputs[0].dtype.name} differs from the scale's {scale.dtype.name}",
                      matmul.name or "")
    return _Weight(dq, codes, scale, zero_point, axis, block)


def _activation(matmul: ir.Node, k: int, trace: Trace | None) -> _Activation:
    """The activation form; a Q/DQ that is not understood is left in place (QMatMul then reads its output)."""
    x = matmul.inputs[0]
    dq = x.producer()
    if not is_op(dq, "DequantizeLinear"):
        return _Activation(x, ACT_NONE)
    try:
        q = dq.inputs[0].producer()
        if not is_op(q, "QuantizeLinear"):
            raise NoMatch("the activation's DequantizeLinear does not read a QuantizeLinear", dq.name or "")
        if q.inputs[1] is not dq.inputs[1] and not _same_constant(q.inputs[1], dq.inputs[1]):
            raise NoMatch("the activation's QuantizeLinear and DequantizeLinear use different scales", dq.name or "")
        zp = q.inputs[2] if len(q.inputs) > 2 and q.inputs[2] is not None else None
        # QuantizeLinear's output dtype: the zero point's, else output_dtype, else uint8.
        quantized = zp.dtype if zp is not None else ir.DataType(_attr(q, "output_dtype", ir.DataType.UINT8))
        if quantized != ir.DataType.FLOAT8E4M3FN:
            raise NoMatch(f"activation quantized to {quantized.name}: only FP8 E4M3 is fused", q.name or "")
        if zp is not None and (zp.const_value is None or np.any(zp.const_value.numpy().astype(np.float32) != 0)):
            raise NoMatch("the activation's FP8 zero point is not a zero constant", q.name or "")
        scale = q.inputs[1]
        block = _attr(q, "block_size", 0)
        if scale.const_value is not None and scale.const_value.size == 1 and block == 0:
            _check_scale(q, scale.const_value.numpy(), negative_ok=False)
            return _Activation(q.inputs[0], ACT_STATIC, scale, zp, (q, dq))
        axis, rank = _attr(q, "axis", 1), (len(x.shape) if x.shape is not None else None)
        last = axis == -1 or (rank is not None and axis == rank - 1)
        if scale.const_value is None and block == k and _attr(dq, "block_size", 0) == k and last \
                and _attr(dq, "axis", 1) == axis:
            return _Activation(q.inputs[0], ACT_DYNAMIC, scale, None, (q, dq))
        raise NoMatch(f"activation Q/DQ with scale {scale.shape} axis {axis} block_size {block}: only a constant "
                      "per-tensor scale or per-token blocks (axis=-1, block_size=K) are fused", q.name or "")
    except NoMatch as err:
        if trace is not None:
            trace.fail(RULE, matmul.name or "", NoMatch(f"activation left unfused: {err.reason}", err.node_name))
        return _Activation(x, ACT_NONE)


def _same_constant(a: ir.Value | None, b: ir.Value | None) -> bool:
    return (a is not None and b is not None and a.const_value is not None and b.const_value is not None
            and np.array_equal(a.const_value.numpy(), b.const_value.numpy()))


class _Constants:
    """The typed placeholder initializers a QMatMul reads where its producer had no such input (shared)."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph

    def get(self, name: str, array: np.ndarray) -> ir.Value:
        if name in self.graph.initializers:
            return self.graph.initializers[name]
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.type, value.shape = ir.TensorType(value.const_value.dtype), ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value


def _fuse(graph: ir.Graph, matmul: ir.Node, w: _Weight, act: _Activation, consts: _Constants) -> None:
    """Replace ``matmul`` (a MatMul, or a MatMulNBits) by a QMatMul reading ``act`` and ``w``."""
    np_dtype = _WEIGHT_DTYPES[w.codes.dtype]
    zero_point = w.zero_point if w.zero_point is not None else consts.get(
        f"{w.codes.name}.zero_point", np.zeros(w.scale.const_value.shape, np_dtype))
    float_np = w.scale.const_value.numpy().dtype
    act_scale = act.scale if act.scale is not None else consts.get(f"trtopt_qmatmul_one_{float_np.name}",
                                                                   np.ones((), float_np))
    act_zp = act.zero_point if act.zero_point is not None else consts.get(
        "trtopt_qmatmul_zero_fp8", np.zeros((), ml_dtypes.float8_e4m3fn))
    # The body's If conditions (plugins/qmatmul/function.py), derived here and only here from the mode.
    flags = [consts.get(f"trtopt_qmatmul_{'true' if on else 'false'}", np.asarray(on, np.bool_))
             for on in (act.mode != ACT_NONE, act.mode == ACT_STATIC)]
    k = int(w.codes.const_value.shape[0])
    attrs = [ir.AttrInt64("axis", w.axis), ir.AttrInt64("block_size", w.block_size),
             ir.AttrInt64("act_mode", act.mode), ir.AttrInt64("act_block_size", k if act.mode == ACT_DYNAMIC else 0),
             ir.AttrInt64("weight_dtype", int(w.codes.dtype))]
    # No plugin_namespace (unlike ops.trtopt_node): TensorRT inlines the body (plugins/qmatmul/trt_plugin.py).
    node = ir.Node(DOMAIN, OP_TYPE, [act.x, w.codes, w.scale, zero_point, act_scale, act_zp, *flags], attrs,
                   name=f"{matmul.name or matmul.outputs[0].name}.qmatmul")
    graph.insert_before(matmul, node)
    replace_output(matmul.outputs[0], node.outputs[0], "q")
    graph.remove(matmul, safe=True)
    for dead in (*([w.dq] if w.dq is not None else []), *reversed(act.nodes)):
        if dead.graph is graph and not any(out.uses() or out.is_graph_output() for out in dead.outputs):
            graph.remove(dead, safe=True)


def _repack_matmul_nbits(graph: ir.Graph, node: ir.Node, consts: _Constants) -> None:
    """com.microsoft.MatMulNBits → QMatMul with the standard layout; NoMatch when the node is outside that form."""
    k, n = _attr(node, "K", 0), _attr(node, "N", 0)
    bits, group, level = _attr(node, "bits", 4), _attr(node, "block_size", 0), _attr(node, "accuracy_level", 0)
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    _, b, scales, zero_points, g_idx, bias = inputs[:6]
    if bits != 4 or group <= 0 or k % group or level not in (0, 1):
        raise NoMatch(f"MatMulNBits with bits={bits}, block_size={group}, K={k}, accuracy_level={level}: only 4-bit "
                      "blocks that divide K with fp32 accumulation (level 0/1) are repacked")
    if g_idx is not None or bias is not None:
        raise NoMatch("MatMulNBits with g_idx or bias is not repacked")
    if b.const_value is None or scales.const_value is None or (zero_points is not None
                                                                and zero_points.const_value is None):
        raise NoMatch("MatMulNBits' packed weight, scales or zero points are not constants")
    blocks = k // group
    packed = b.const_value.numpy().reshape(n, blocks, group // 2)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)  # [N, K], low nibble first
    scale = scales.const_value.numpy().reshape(n, blocks)
    if zero_points is None:
        zp = np.full((n, blocks), 8, np.uint8)
    elif zero_points.dtype != ir.DataType.UINT8:
        raise NoMatch(f"MatMulNBits zero points of dtype {zero_points.dtype.name} (not packed uint8) are not repacked")
    else:
        zp_packed = zero_points.const_value.numpy().reshape(n, -1)
        zp = np.stack([zp_packed & 0x0F, zp_packed >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    _check_scale(node, scale, negative_ok=True)
    name = node.name or node.outputs[0].name
    codes_v = consts.get(f"{name}.weight_quantized", np.ascontiguousarray(codes.T).astype(ml_dtypes.uint4))
    scale_v = consts.get(f"{name}.weight_scale", np.ascontiguousarray(scale.T))
    zp_v = consts.get(f"{name}.weight_zero_point", np.ascontiguousarray(zp.T).astype(ml_dtypes.uint4))
    w = _Weight(None, codes_v, scale_v, zp_v, axis=0, block_size=group)
    _fuse(graph, node, w, _Activation(node.inputs[0], ACT_NONE), consts)


FP8_MAX = 448.0  # E4M3FN's largest finite value: a saturating QuantizeLinear clamps to it


def _fold_constant_fp8_quantize(graph: ir.Graph, consts: _Constants) -> int:
    """ModelOpt's FP8 form of a weight: QuantizeLinear(constant fp32 weight [K, N], scale [N] or scalar, E4M3FN zero
    point) → DequantizeLinear (TensorRT folds the Q itself). Each such QuantizeLinear, read only by
    DequantizeLinears, becomes its codes as an initializer, so `_weight` reads a constant: x / scale in fp32, clamped
    to ±448 (ONNX's saturate=1) and rounded to nearest even (ml_dtypes), which is ONNX Runtime's QuantizeLinear bit
    for bit (tests/fusion_passes/test_qmatmul.py compares them). Other QuantizeLinears are left as they are."""
    count = 0
    for q in [n for n in graph if is_op(n, "QuantizeLinear") and len(n.inputs) == 3]:
        x, scale, zero_point = q.inputs
        out = q.outputs[0]
        if any(v is None or v.const_value is None for v in (x, scale, zero_point)):
            continue
        xs, ss, zs = (v.const_value.numpy() for v in (x, scale, zero_point))
        axis = _attr(q, "axis", 1)
        if (xs.dtype != np.float32 or ss.dtype != np.float32 or zs.dtype != ml_dtypes.float8_e4m3fn
                or xs.ndim != 2 or ss.shape not in ((), (xs.shape[axis % 2],)) or zs.shape != ss.shape
                or _attr(q, "saturate", 1) != 1 or _attr(q, "block_size", 0) != 0
                or zs.astype(np.float32).any() or out.is_graph_output()
                or not all(is_op(u, "DequantizeLinear") for u, _ in out.uses())):
            continue
        s = ss if ss.ndim == 0 else (ss[None, :] if axis % 2 == 1 else ss[:, None])
        codes = np.clip(xs / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        replace_value(out, consts.get(f"{out.name or x.name}.folded", codes))
        graph.remove(q, safe=True)  # read by nothing now; cleanup drops the fp32 weight it read
        count += 1
    return count


def fuse_qmatmul(model: ir.Model, trace: Trace | None = None) -> int:
    """Fuse every DequantizeLinear(weight) → MatMul (and its activation Q/DQ); returns the count."""
    graph = model.graph
    _fold_constant_fp8_quantize(graph, _Constants(graph))
    candidates = [n for n in graph if is_op(n, "MatMul") and n.inputs[1] is not None
                  and is_op(n.inputs[1].producer(), "DequantizeLinear")]
    nbits = [n for n in graph if n.domain == "com.microsoft" and n.op_type == "MatMulNBits"]
    if not candidates and not nbits:
        return 0
    opset = model.opset_imports.get("", 0)
    consts, count = _Constants(graph), 0
    for node in nbits:
        try:
            if opset < BLOCKED_OPSET:
                raise NoMatch(f"MatMulNBits in a model of opset {opset}: repacking it into blocked Q/DQ needs "
                              f"opset >= {BLOCKED_OPSET}")
            _repack_matmul_nbits(graph, node, consts)
            count += 1
        except NoMatch as err:
            if trace is not None:
                trace.fail(RULE, node.name or "", err)
    for matmul in candidates:
        try:
            if opset < MIN_OPSET:
                raise NoMatch(f"the model's opset {opset} is below {MIN_OPSET} (FP8 Q/DQ); re-export it newer")
            w = _weight(matmul)
        except NoMatch as err:
            if trace is not None:
                trace.fail(RULE, matmul.name or "", err)
            continue
        act = _activation(matmul, int(w.codes.const_value.shape[0]), trace)
        assert opset >= BLOCKED_OPSET or (w.block_size == 0 and act.mode != ACT_DYNAMIC), "blocked Q/DQ below 21"
        _fuse(graph, matmul, w, act, consts)
        count += 1
    if count:
        declare_domain(model)
    return count
