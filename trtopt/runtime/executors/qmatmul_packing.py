"""QMatMul weights packed once at load for the GEMV and GEMMs (the torch executor on CUDA; docs/architecture.md §4).

A converted trtopt.QMatMul reads the plan's w_q [K, N] (INT4/UINT4 one int8/uint8 a value), scale and zero point.
On CUDA `trtopt_ops.qmatmul` runs plugins/qmatmul/kernel.py `qmatmul_triton`, which packs them into the kernels'
layout (plugins/qmatmul/packing.py: one layout that the decode GEMV, the Triton GEMM and torch._scaled_mm all read)
on every call: several reads of the weight and host syncs per projection.
`pack_qmatmul_weights` packs each constant weight once, as gemv.py stores MatMul weights [N, K] once:

1. every QMatMul whose w_q, w_scale and w_zero_point are constants on CUDA, in a form `packing.packable` takes,
   gets the packed tensors as buffers of the module and runs `qmatmul_packed_call` (kernel.py `qmatmul_packed`);
2. the plan's buffers it read are dropped when nothing else reads them, so memory does not grow (INT4: it
   halves).

3. a dynamic per-token activation scale computed by the quantizer's formula (Max(Div(ReduceMax(Abs(x)), 448),
   tiny), quantize/qdq.py `write_dynamic_fp8`) from the call's own x moves into the activation's quantize launch
   (gemm.py `DynamicScale`: the same values, bit for bit) and its four ops leave the graph: four kernels less a
   W8A8 projection. They are the likeliest cause (not yet measured apart) of a 1.24B W8A8-dynamic plan's batch-1
   decode at 0.59x of bf16 on an H200, where FP8 weight-only ran 1.11x (docs/benchmarks/
   quant_e2e_workload_h200.json, measured before this rewrite).

4. (`fuse_norm_quantize`, after 3) a W8A8 projection with that folded per-token scale, or with a static
   per-tensor scale (a constant), whose input is read by nothing else and made by an RMSNorm (Llama's Q/K/V and
   gate/up after horizontal fusion: trtopt.RMSNorm, or output 0 of trtopt.AddRMSNorm), a SiluMul or a GeluMul
   (the down projection) takes its FP8 codes and row scale from that op's launch (plugins/rms_norm/kernel.py
   `rms_norm_fp8_triton`, plugins/add_rms_norm/kernel.py `add_rms_norm_fp8_triton`, plugins/silu_mul/kernel.py
   `silu_mul_fp8_triton`, plugins/gelu_mul/kernel.py `gelu_mul_fp8_triton`: the op's kernel then the quantize
   launch, bit for bit) and runs `qmatmul_codes_call`: one launch a projection less, and the op's bf16 row is
   neither written nor read back. Only O keeps the quantize launch (its input is the attention's).

5. (`fuse_norm_pack_x`) an INT4/UINT4 weight-only projection whose input is read by nothing else and made by one of
   those ops takes that op's xp form (plugins/rms_norm/kernel.py `rms_norm_xp_triton` and the three like it): on a
   step the "half2_xp" GEMV runs (up to kernel.py XP_GEMV_MAX_ROWS rows of bf16/fp16), the op's launch also packs
   its row into the GEMV's half2 words (the separate x launch's words, bit for bit) and `qmatmul_xp_call` runs the
   GEMV on them; on other steps the op writes its row alone and the projection runs `qmatmul_packed`. One launch a
   projection less at decode; O keeps the x launch.

The values are the unrewritten op's: `qmatmul_triton` is `pack_weight` then `qmatmul_packed`. Other QMatMuls, every
one on the CPU (the reference), and graphs under torch.compile (the custom op, torch_library.py) keep the op.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from trtopt.plugins.qmatmul.packing import PackedQWeight, pack_weight, packable
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_STATIC
from trtopt.runtime.executors import trtopt_ops
from trtopt.runtime.executors.fx_fusions import recompiled, replace_node


@functools.cache
def _kernel():
    try:
        from trtopt.plugins.qmatmul import kernel
    except ImportError:  # no Triton: the op's reference path is always correct
        return None
    return kernel


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def qmatmul_packed_call(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        act_scale: torch.Tensor | None, *, k: int, group: int, zero_const: int, act_mode: int,
                        dynamic_min_scale: float = 0.0) -> torch.Tensor:
    """trtopt::QMatMul on a weight packed at load: PackedQWeight's tensors (data [N, ·], scale, zero or None) and
    fields, then kernel.py `qmatmul_packed` (the GEMV for steps of up to `gemv_max_rows` rows, else a tensor-core
    GEMM: plugins/qmatmul/gemm.py). act_scale None: the per-token scale computed in the kernels (gemm.py
    `DynamicScale(x.dtype, dynamic_min_scale)`: the graph's Div runs in x's dtype whatever the dtype of its tiny
    constant, and the Max after it only widens)."""
    from trtopt.plugins.qmatmul.gemm import DynamicScale

    w = PackedQWeight(data, scale, zero, zero_const, k, data.shape[0], group)
    dynamic = DynamicScale(x.dtype, dynamic_min_scale) if act_scale is None else None
    return _kernel().qmatmul_packed(x, w, act_scale, act_mode=act_mode, dynamic=dynamic)


def qmatmul_codes_call(codes: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype, data: torch.Tensor,
                       scale: torch.Tensor, zero: torch.Tensor | None, *, k: int, group: int,
                       zero_const: int) -> torch.Tensor:
    """A W8A8 trtopt::QMatMul whose activation arrives quantized (codes, row scale and the activation's dtype, from
    `rms_norm_fp8_call` / `add_rms_norm_fp8_call`) on a weight packed at load: kernel.py `qmatmul_codes`."""
    w = PackedQWeight(data, scale, zero, zero_const, k, data.shape[0], group)
    return _kernel().qmatmul_codes(codes, row_scale, w, out_dtype=out_dtype)


# The FP8 forms of the ops below take the projection's activation scale as `act_scale` (static, per tensor) or, with
# act_scale None, compute its dynamic per-token scale (`min_scale`: the formula's floor).
def rms_norm_fp8_call(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float, min_scale: float = 0.0,
                      act_scale: torch.Tensor | None = None):
    """trtopt::RMSNorm's output as FP8 codes: (codes, row scale, the output's dtype)."""
    from trtopt.plugins.rms_norm.kernel import rms_norm_fp8_triton

    return rms_norm_fp8_triton(x, scale, epsilon=epsilon, min_scale=min_scale, act_scale=act_scale)


def add_rms_norm_fp8_call(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *, epsilon: float,
                          min_scale: float = 0.0, act_scale: torch.Tensor | None = None):
    """trtopt::AddRMSNorm with y as FP8 codes: (sum, codes, row scale, y's dtype). A broadcasting add (which
    trtopt_ops.add_rms_norm gives to the reference) normalizes through the op, then quantizes in the activation's
    quantize launch: the same values either way."""
    if x.shape == residual.shape and x.dtype == residual.dtype:
        from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_fp8_triton

        return add_rms_norm_fp8_triton(x, residual, scale, epsilon=epsilon, min_scale=min_scale, act_scale=act_scale)
    from trtopt.plugins.qmatmul.gemm import activation_fp8

    y, total = trtopt_ops.add_rms_norm(x, residual, scale, epsilon=epsilon)
    return (total, *activation_fp8(y, act_scale, min_scale))


def silu_mul_fp8_call(gate: torch.Tensor, up: torch.Tensor, *, min_scale: float = 0.0,
                      act_scale: torch.Tensor | None = None):
    """trtopt::SiluMul's output as FP8 codes: (codes, row scale, the output's dtype)."""
    from trtopt.plugins.silu_mul.kernel import silu_mul_fp8_triton

    return silu_mul_fp8_triton(gate, up, min_scale=min_scale, act_scale=act_scale)


def gelu_mul_fp8_call(gate: torch.Tensor, up: torch.Tensor, *, tanh: int, min_scale: float = 0.0,
                      act_scale: torch.Tensor | None = None):
    """trtopt::GeluMul's output as FP8 codes: (codes, row scale, the output's dtype)."""
    from trtopt.plugins.gelu_mul.kernel import gelu_mul_fp8_triton

    return gelu_mul_fp8_triton(gate, up, tanh=tanh, min_scale=min_scale, act_scale=act_scale)


def qmatmul_xp_call(x: torch.Tensor, xpack: torch.Tensor | None, down: torch.Tensor | None, data: torch.Tensor,
                    scale: torch.Tensor, zero: torch.Tensor | None, *, k: int, group: int,
                    zero_const: int) -> torch.Tensor:
    """An INT4/UINT4 weight-only trtopt::QMatMul whose input's producer also packed it for the "half2_xp" GEMV
    (rewrite 5; xpack and down None where that step does not run the GEMV): kernel.py `qgemv_xp` on the packed words,
    else `qmatmul_packed` on x. The same values either way."""
    w = PackedQWeight(data, scale, zero, zero_const, k, data.shape[0], group)
    if xpack is None:
        return _kernel().qmatmul_packed(x, w, None)
    return _kernel().qgemv_xp(xpack, down, w, x.dtype).reshape(*x.shape[:-1], w.n)


# The xp forms of the ops below return their outputs and then (xpack, down) for the GEMV, or (None, None).
def rms_norm_xp_call(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float, group: int):
    """trtopt::RMSNorm with its row packed for the INT4 GEMV: (y, xpack, down)."""
    from trtopt.plugins.rms_norm.kernel import rms_norm_xp_triton

    return rms_norm_xp_triton(x, scale, epsilon=epsilon, group=group)


def add_rms_norm_xp_call(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *, epsilon: float,
                         group: int):
    """trtopt::AddRMSNorm with y packed for the INT4 GEMV: (y, sum, xpack, down). A broadcasting add (which
    trtopt_ops.add_rms_norm gives to the reference) runs the op and leaves the packing to the projection."""
    if x.shape == residual.shape and x.dtype == residual.dtype:
        from trtopt.plugins.add_rms_norm.kernel import add_rms_norm_xp_triton

        return add_rms_norm_xp_triton(x, residual, scale, epsilon=epsilon, group=group)
    return (*trtopt_ops.add_rms_norm(x, residual, scale, epsilon=epsilon), None, None)


def silu_mul_xp_call(gate: torch.Tensor, up: torch.Tensor, *, group: int):
    """trtopt::SiluMul with its row packed for the INT4 GEMV: (y, xpack, down)."""
    from trtopt.plugins.silu_mul.kernel import silu_mul_xp_triton

    return silu_mul_xp_triton(gate, up, group=group)


def gelu_mul_xp_call(gate: torch.Tensor, up: torch.Tensor, *, tanh: int, group: int):
    """trtopt::GeluMul with its row packed for the INT4 GEMV: (y, xpack, down)."""
    from trtopt.plugins.gelu_mul.kernel import gelu_mul_xp_triton

    return gelu_mul_xp_triton(gate, up, tanh=tanh, group=group)


# the ops whose launch may pack an INT4 projection's input (`fuse_norm_pack_x`): the op → its xp form, and the
# output of the xp form's tuple where (xpack, down) begin (the outputs before it are the op's own)
_XP_FORMS = {trtopt_ops.rms_norm: (rms_norm_xp_call, 1), trtopt_ops.silu_mul: (silu_mul_xp_call, 1),
             trtopt_ops.gelu_mul: (gelu_mul_xp_call, 1), trtopt_ops.add_rms_norm: (add_rms_norm_xp_call, 2)}


# the ops whose launch may quantize a W8A8 projection's input (`fuse_norm_quantize`): the op → its FP8 form, and the
# output of the FP8 form's tuple where (codes, row scale, dtype) begin
_FP8_FORMS = {trtopt_ops.rms_norm: (rms_norm_fp8_call, 0), trtopt_ops.silu_mul: (silu_mul_fp8_call, 0),
              trtopt_ops.gelu_mul: (gelu_mul_fp8_call, 0), trtopt_ops.add_rms_norm: (add_rms_norm_fp8_call, 1)}


def _const(gm: torch.fx.GraphModule, arg) -> torch.Tensor | float | None:
    """A node argument's constant value: a Python number, or a get_attr's 0-d tensor; else None."""
    if isinstance(arg, (int, float)):
        return arg
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = getattr(gm, arg.target, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value
    return None


def _call_of(arg, *targets) -> bool:
    return isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target in targets


def _dynamic_scale(gm: torch.fx.GraphModule, x, scale) -> tuple[float, list[torch.fx.Node]] | None:
    """(min scale, the nodes) when `scale` is the quantizer's per-token formula of `x` (quantize/qdq.py
    `write_dynamic_fp8`): Max(Div(ReduceMax(Abs(x), axes=[-1], keepdims=1), 448), tiny) with tiny a constant float
    tensor whose value the kernels' fp32 holds exactly; else None."""
    from trtopt.plugins.qmatmul.reference import FP8_MAX
    from trtopt.runtime.executors import onnx_ops

    if not (isinstance(scale, torch.fx.Node) and scale.op == "call_function" and len(scale.args) == 2
            and getattr(scale.target, "__name__", "") in ("variadic_maximum", "maximum")):
        return None
    ratio, tiny = scale.args
    tiny = _const(gm, tiny)
    if not (isinstance(tiny, torch.Tensor) and tiny.is_floating_point() and _call_of(ratio, onnx_ops.div)
            and float(tiny.float()) == float(tiny)):
        return None
    amax, fmax = ratio.args
    fmax = _const(gm, fmax)
    if fmax is None or float(fmax) != FP8_MAX or not _call_of(amax, onnx_ops.reduce_max):
        return None
    axes = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("axes")
    if list(axes or ()) != [-1] or amax.kwargs.get("keepdims", 1) != 1 or not _call_of(amax.args[0], torch.abs):
        return None
    if amax.args[0].args[0] is not x:
        return None
    return float(tiny), [scale, ratio, amax, amax.args[0]]


def _axis_fits(axis: int, block_size: int) -> bool:
    """The weight's DequantizeLinear axis is the one the packed layout assumes: FP8 per output column (axis 1),
    INT4/UINT4 blocked over K (axis 0)."""
    return axis in ((1, -1) if block_size == 0 else (0, -2))


def _buffer(gm: torch.fx.GraphModule, name: str, value: torch.Tensor) -> str:
    """Register `value` as a buffer of gm under a free name built from `name`; returns the name."""
    free, i = name, 0
    while hasattr(gm, free):
        i += 1
        free = f"{name}_{i}"
    gm.register_buffer(free, value)
    return free


def _drop_if_unread(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Erase a get_attr node nothing reads, and its attribute when no other node reads that attribute."""
    if node.users:
        return
    gm.graph.erase_node(node)
    if not any(n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes):
        delattr(gm, node.target)


def pack_qmatmul_weights(gm: torch.fx.GraphModule) -> int:
    """Apply the rewrite above; returns the QMatMul calls that now read a packed weight. A weight several calls read
    (the same three constants and block size) is packed once."""
    packed: dict[tuple, tuple[list[torch.fx.Node | None], dict]] = {}  # (w_q, scale, zp targets, block) → reads
    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is trtopt_ops.qmatmul]:
        consts = node.args[1:4]
        if len(node.args) < 5 or not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in consts):
            continue
        w_q, scale, zero = (getattr(gm, a.target, None) for a in consts)
        block = node.kwargs.get("block_size", 0)
        if not (all(isinstance(t, torch.Tensor) for t in (w_q, scale, zero)) and _on_gpu(w_q)
                and _axis_fits(node.kwargs.get("axis", 1), block) and packable(w_q, scale, block_size=block)
                and _kernel() is not None):
            continue
        key = (*(a.target for a in consts), block)
        if key not in packed:
            w = pack_weight(w_q, scale, zero, block_size=block)
            with gm.graph.inserting_before(node):
                reads = [None if t is None else gm.graph.get_attr(_buffer(gm, f"{consts[0].target}_packed_{part}", t))
                         for part, t in (("data", w.data), ("scale", w.scale), ("zero", w.zero))]
            packed[key] = reads, dict(k=w.k, group=w.group, zero_const=w.zero_const)
        reads, fields = packed[key]
        old_consts = dict.fromkeys(a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr")
        act_mode, act_scale = node.kwargs.get("act_mode", 0), node.args[4]
        dynamic = _dynamic_scale(gm, node.args[0], act_scale) if act_mode == ACT_DYNAMIC else None
        if dynamic is not None:  # the scale's four ops move into the activation's quantize launch
            min_scale, scale_nodes = dynamic
            fields = dict(fields, dynamic_min_scale=min_scale)
            act_scale = None
        replace_node(gm, node, qmatmul_packed_call, (node.args[0], *reads, act_scale), dict(fields, act_mode=act_mode))
        if dynamic is not None:
            for n in scale_nodes:  # Max, Div, ReduceMax, Abs: erased once nothing else reads them
                if not n.users:
                    consts = [a for a in n.all_input_nodes if a.op == "get_attr"]
                    gm.graph.erase_node(n)
                    for const in consts:
                        _drop_if_unread(gm, const)
        for const in old_consts:  # the plan's weight, and the zero point and flags the packed call does not read
            _drop_if_unread(gm, const)
        count += 1
    return recompiled(gm, count)


def _producer(x: torch.fx.Node) -> torch.fx.Node | None:
    """The call of an op of _FP8_FORMS (and _XP_FORMS: the same ops) that produces x: x itself (RMSNorm, SiluMul,
    GeluMul), or the AddRMSNorm whose output 0 x is, when its other readers take only its sum; else None."""
    if _call_of(x, trtopt_ops.rms_norm, trtopt_ops.silu_mul, trtopt_ops.gelu_mul):
        return x
    if not (_call_of(x, operator.getitem) and x.args[1] == 0 and _call_of(x.args[0], trtopt_ops.add_rms_norm)):
        return None
    norm = x.args[0]
    others = [u for u in norm.users if u is not x]
    if not all(_call_of(u, operator.getitem) and u.args[1] == 1 for u in others):
        return None
    return norm


def fuse_norm_quantize(gm: torch.fx.GraphModule) -> int:
    """Rewrite 4 of the module docstring, after `pack_qmatmul_weights`; returns the projections that now read their
    codes from the launch of the op that produces their input."""
    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is qmatmul_packed_call]:
        x, act_scale, act_mode = node.args[0], node.args[4], node.kwargs.get("act_mode", 0)
        if act_mode == ACT_DYNAMIC and act_scale is None:  # the scale folded into the kernels (rewrite 3)
            scale_kwargs = {"min_scale": node.kwargs.get("dynamic_min_scale", 0.0)}
        elif act_mode == ACT_STATIC and isinstance(act_scale, torch.fx.Node) and act_scale.op == "get_attr":
            scale_kwargs = {"act_scale": act_scale}  # one calibrated scale, a constant
        else:
            continue
        if not (node.kwargs.get("group") == 0 and isinstance(x, torch.fx.Node) and set(x.users) == {node}):
            continue
        producer = _producer(x)
        if producer is None:
            continue
        fp8_form, first = _FP8_FORMS[producer.target]
        if "act_scale" in scale_kwargs:
            producer.prepend(act_scale)  # the constant's read moves before the producer, which now reads it
        with gm.graph.inserting_before(producer):
            fused = gm.graph.call_function(fp8_form, producer.args, dict(producer.kwargs, **scale_kwargs))
            sums = [u for u in producer.users if u is not x] if producer is not x else []
            for user in sums:  # AddRMSNorm's sum (the readers of its output 1): output 0 of the FP8 form
                with gm.graph.inserting_before(user):
                    user.replace_all_uses_with(gm.graph.call_function(operator.getitem, (fused, 0)))
                gm.graph.erase_node(user)
            codes, row_scale, out_dtype = (gm.graph.call_function(operator.getitem, (fused, first + i))
                                           for i in range(3))
        fields = {key: node.kwargs[key] for key in ("k", "group", "zero_const")}
        replace_node(gm, node, qmatmul_codes_call, (codes, row_scale, out_dtype, *node.args[1:4]), fields)
        if producer is not x:  # AddRMSNorm's getitem of output 0
            gm.graph.erase_node(x)
        gm.graph.erase_node(producer)
        count += 1
    return recompiled(gm, count)


def fuse_norm_pack_x(gm: torch.fx.GraphModule) -> int:
    """Rewrite 5 of the module docstring, after `pack_qmatmul_weights`; returns the projections whose input's
    producer now packs it for the GEMV."""
    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is qmatmul_packed_call]:
        x, group = node.args[0], node.kwargs.get("group", 0)
        if not (node.kwargs.get("act_mode", 0) == 0 and group > 0 and isinstance(x, torch.fx.Node)
                and set(x.users) == {node}):  # weight-only INT4/UINT4 (FP8 weights are per channel: group 0)
            continue
        producer = _producer(x)
        if producer is None:
            continue
        xp_form, first = _XP_FORMS[producer.target]
        with gm.graph.inserting_before(producer):
            fused = gm.graph.call_function(xp_form, producer.args, dict(producer.kwargs, group=group))
            xpack, down = (gm.graph.call_function(operator.getitem, (fused, first + i)) for i in range(2))
            if producer is x:  # RMSNorm, SiluMul, GeluMul: y is output 0 of the xp form
                y = gm.graph.call_function(operator.getitem, (fused, 0))
        if producer is x:
            producer.replace_all_uses_with(y)
        else:  # AddRMSNorm: its getitems of y and the sum read the xp form's outputs 0 and 1 as they read the op's
            producer.replace_all_uses_with(fused)
            y = x
        fields = {key: node.kwargs[key] for key in ("k", "group", "zero_const")}
        replace_node(gm, node, qmatmul_xp_call, (y, xpack, down, *node.args[1:4]), fields)
        gm.graph.erase_node(producer)
        count += 1
    return recompiled(gm, count)
