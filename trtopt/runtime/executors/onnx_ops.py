"""Standard ONNX ops as plain torch functions, for the onnx-ir → torch.fx converter (onnx_to_torch.py).

Each op is one function: inputs positionally (None for an absent optional input), attributes as keyword
arguments named and defaulted exactly as in the ONNX spec. The converter passes a constant "shape-like" input
(Reshape's shape, Slice's starts...) as a Python list instead of a tensor, so every function here accepts both;
that turns most shape arithmetic into conversion-time work instead of per-step `.tolist()` calls.

Semantics follow opset 13+ (the converter refuses older models). Where an op changed an attribute into an input
(Squeeze/Unsqueeze/ReduceMean axes, Split's split) both forms are accepted.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

# ONNX TensorProto.DataType enum → torch dtype (the types our plans can carry).
ONNX_TO_TORCH_DTYPE: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    4: torch.uint16,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    12: torch.uint32,
    13: torch.uint64,
    16: torch.bfloat16,
}

IntsLike = Sequence[int] | torch.Tensor
_INT64_MAX = 2**63 - 1


def as_ints(value: IntsLike) -> list[int]:
    """A shape-like input as a list of Python ints (a constant list passes through untouched)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    return list(value)


def _optional_ints(value: IntsLike | None) -> list[int] | None:
    return None if value is None else as_ints(value)


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# ---------------------------------------------------------------------------------------------------------------------
# Elementwise math. Binary ops broadcast like numpy, exactly as torch does.
# ---------------------------------------------------------------------------------------------------------------------
def div(a, b):
    # ONNX integer Div truncates toward zero (as C does); torch's `/` would promote to float.
    if isinstance(a, torch.Tensor) and not a.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


def pow_(a, b):
    # The result keeps the base's dtype (ONNX Pow), whatever the exponent's type.
    if isinstance(b, (int, float)) and b == 2:
        return a * a
    return torch.pow(a, b).to(a.dtype)


def mod(a, b, *, fmod: int = 0):
    return torch.fmod(a, b) if fmod else torch.remainder(a, b)


def variadic(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def reduce_inputs(*xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return out

    reduce_inputs.__name__ = f"variadic_{fn.__name__}"
    return reduce_inputs


def mean_(*xs):
    return variadic(operator.add)(*xs) / len(xs)


def clip(x, lo=None, hi=None, *, min=None, max=None):  # noqa: A002 - ONNX attribute names (opset < 11)
    lo = min if lo is None else lo
    hi = max if hi is None else hi
    return torch.clamp(x, lo, hi)


def gelu(x, *, approximate: str = "none"):
    return F.gelu(x, approximate=approximate)


def leaky_relu(x, *, alpha: float = 0.01):
    return F.leaky_relu(x, alpha)


def hard_sigmoid(x, *, alpha: float = 0.2, beta: float = 0.5):
    return torch.clamp(x * alpha + beta, 0, 1)


def cast(x, *, to: torch.dtype, saturate: int = 1):
    return x.to(to)


def cast_like(x, target, *, saturate: int = 1):
    return x.to(target.dtype)


def identity(x):
    return x


def dropout(x, ratio=None, training_mode=None, *, seed: int = 0, _n: int = 1):
    # Inference only: the mask output, when asked for, is all true.
    return (x, torch.ones_like(x, dtype=torch.bool)) if _n > 1 else x


# ---------------------------------------------------------------------------------------------------------------------
# Shapes and indexing.
# ---------------------------------------------------------------------------------------------------------------------
def shape(x, *, start: int = 0, end: int | None = None):
    # Shapes live on the host whatever x's device: shape arithmetic then never syncs with the GPU.
    return torch.tensor(x.shape[start:end], dtype=torch.int64)


def size(x):
    return torch.tensor(x.numel(), dtype=torch.int64)


def reshape(x, new_shape: IntsLike, *, allowzero: int = 0):
    dims = as_ints(new_shape)
    if not allowzero:
        # 0 copies the input's dim at that position.
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def flatten(x, *, axis: int = 1):
    axis = _axis(axis, x.dim())
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def transpose(x, *, perm: list[int] | None = None):
    return x.permute(perm if perm is not None else list(range(x.dim() - 1, -1, -1)))


def squeeze(x, axes_in: IntsLike | None = None, *, axes: list[int] | None = None):
    axes = _optional_ints(axes_in) if axes_in is not None else axes
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(_axis(a, x.dim()) for a in axes)) if axes else x


def unsqueeze(x, axes_in: IntsLike | None = None, *, axes: list[int] | None = None):
    axes = as_ints(axes_in) if axes_in is not None else list(axes)
    rank = x.dim() + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        x = x.unsqueeze(a)
    return x


def concat(*xs, axis: int):
    return torch.cat(xs, dim=axis)


def split(x, split_in: IntsLike | None = None, *, axis: int = 0, num_outputs: int | None = None,
          split: list[int] | None = None, _n: int):
    sizes = as_ints(split_in) if split_in is not None else split
    if sizes is None:
        # Equal parts; with num_outputs (opset 18) the last part may be smaller.
        parts = num_outputs or _n
        sizes = -(-x.shape[axis] // parts)
    return torch.split(x, sizes, dim=axis)


def slice_(x, starts: IntsLike, ends: IntsLike, axes: IntsLike | None = None, steps: IntsLike | None = None):
    starts, ends = as_ints(starts), as_ints(ends)
    axes = _optional_ints(axes) or list(range(len(starts)))
    steps = _optional_ints(steps) or [1] * len(starts)
    index: list[Any] = [slice(None)] * x.dim()
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, x.dim())
        dim = x.shape[axis]
        if step > 0:
            # Python slicing clamps exactly like ONNX for step > 0; bounding INT64_MAX-style ends first keeps
            # torch from warning about truncation.
            index[axis] = slice(max(min(start, dim), -dim - 1), max(min(end, dim), -dim - 1), step)
            continue
        # torch has no negative steps: select the range reversed, then flip.
        if end == _INT64_MAX:
            # onnxruntime (and torch's exporters, which emit it) read INT64_MAX as "through the first element"
            # for a negative step, although the spec's clamping would make the slice empty; follow onnxruntime.
            end = -dim - 1
        start = min(max(start + dim if start < 0 else start, 0), dim - 1)
        end = min(max(end + dim if end < 0 else end, -1), dim - 1)
        picked = list(range(start, end, step))
        if not picked:
            index[axis] = slice(0, 0)
            continue
        index[axis] = slice(picked[-1], picked[0] + 1, -step)
        flips.append(axis)
    out = x[tuple(index)]
    return out.flip(flips) if flips else out


def gather(x, indices, *, axis: int = 0):
    axis = _axis(axis, x.dim())
    dim = x.shape[axis]
    if isinstance(indices, int):
        return x.select(axis, indices + dim if indices < 0 else indices)
    indices = torch.where(indices < 0, indices + dim, indices)
    picked = x.index_select(axis, indices.reshape(-1))
    return picked.reshape(x.shape[:axis] + indices.shape + x.shape[axis + 1 :])


def gather_nonnegative(x, indices, *, axis: int = 0):
    """gather for indices known to be >= 0 (the executor proves it from the signature: fx_fusions.gather_nonnegative):
    the same result without the negative-index wrap, one index_select."""
    axis = _axis(axis, x.dim())
    picked = x.index_select(axis, indices.reshape(-1))
    return picked.reshape(x.shape[:axis] + indices.shape + x.shape[axis + 1 :])


def gather_elements(x, indices, *, axis: int = 0):
    axis = _axis(axis, x.dim())
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    return torch.gather(x, axis, indices)


def gather_nd(data, indices, *, batch_dims: int = 0):
    # data: [b..., d...]; indices: [b..., i..., k]. Flatten the batch dims into one, then index.
    batch_shape = data.shape[:batch_dims]
    nb = math.prod(batch_shape)
    k = indices.shape[-1]
    data = data.reshape((nb,) + data.shape[batch_dims:])
    idx = indices.reshape((nb, -1, k))  # [nb, m, k]
    idx = torch.where(idx < 0, idx + torch.tensor(data.shape[1 : 1 + k], device=idx.device), idx)
    batch = torch.arange(nb, device=data.device)[:, None].expand(nb, idx.shape[1])
    picked = data[(batch,) + tuple(idx[..., j] for j in range(k))]  # [nb, m, rest...]
    return picked.reshape(indices.shape[:-1] + data.shape[1 + k :])


def scatter_nd(data, indices, updates, *, reduction: str = "none"):
    out = data.clone()
    k = indices.shape[-1]
    index = tuple(indices[..., j] for j in range(k))
    if reduction == "none":
        out[index] = updates
    elif reduction == "add":
        out.index_put_(index, updates, accumulate=True)
    else:
        # mul/max/min with duplicate indices have no single torch call; apply each update in order.
        flat_idx = indices.reshape(-1, k).tolist()
        flat_upd = updates.reshape((len(flat_idx),) + updates.shape[indices.dim() - 1 :])
        combine = {"mul": torch.mul, "max": torch.maximum, "min": torch.minimum}[reduction]
        for i, upd in zip(flat_idx, flat_upd):
            out[tuple(i)] = combine(out[tuple(i)], upd)
    return out


def scatter_elements(data, indices, updates, *, axis: int = 0, reduction: str = "none"):
    axis = _axis(axis, data.dim())
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    if reduction == "none":
        return torch.scatter(data, axis, indices, updates)
    reduce = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[reduction]
    return torch.scatter_reduce(data, axis, indices, updates, reduce=reduce, include_self=True)


def expand(x, new_shape: IntsLike):
    # ONNX Expand broadcasts both ways: a 1 in `new_shape` keeps the input's dim.
    return x.expand(torch.broadcast_shapes(x.shape, tuple(as_ints(new_shape))))


def tile(x, repeats: IntsLike):
    return x.repeat(as_ints(repeats))


def constant_of_shape(new_shape: IntsLike, *, value: Any = 0.0, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu"):
    return torch.full(as_ints(new_shape), value, dtype=dtype, device=device)


def _scalar(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def range_(start, limit, delta):
    dtype = start.dtype if isinstance(start, torch.Tensor) else None
    device = start.device if isinstance(start, torch.Tensor) else None
    return torch.arange(_scalar(start), _scalar(limit), _scalar(delta), dtype=dtype, device=device)


def trilu(x, k=None, *, upper: int = 1):
    diagonal = int(_scalar(k)) if k is not None else 0
    return torch.triu(x, diagonal) if upper else torch.tril(x, diagonal)


def pad(x, pads: IntsLike, constant_value=None, axes: IntsLike | None = None, *, mode: str = "constant"):
    pads = as_ints(pads)
    n = len(pads) // 2
    axes = [_axis(a, x.dim()) for a in (_optional_ints(axes) or range(x.dim()))]
    # ONNX: [begin_0, begin_1, ..., end_0, end_1, ...]; F.pad: last dim first, (begin, end) pairs.
    per_axis = {a: (pads[i], pads[i + n]) for i, a in enumerate(axes)}
    torch_pads: list[int] = []
    for a in range(x.dim() - 1, -1, -1):
        torch_pads += per_axis.get(a, (0, 0))
    if mode == "constant":
        return F.pad(x, torch_pads, value=_scalar(constant_value) if constant_value is not None else 0)
    return F.pad(x, torch_pads, mode={"reflect": "reflect", "edge": "replicate"}[mode])


def where(cond, x, y):
    return torch.where(cond, x, y)


def cumsum(x, axis, *, exclusive: int = 0, reverse: int = 0):
    axis = int(_scalar(axis))
    if reverse:
        x = x.flip(axis)
    out = torch.cumsum(x, axis).to(x.dtype)
    if exclusive:
        out = out - x
    return out.flip(axis) if reverse else out


# ---------------------------------------------------------------------------------------------------------------------
# Reductions and normalisations.
# ---------------------------------------------------------------------------------------------------------------------
def _reduce(fn: Callable[..., torch.Tensor]):
    def reduce(x, axes_in: IntsLike | None = None, *, axes: list[int] | None = None, keepdims: int = 1,
               noop_with_empty_axes: int = 0):
        axes = _optional_ints(axes_in) if axes_in is not None else axes
        if not axes:
            if noop_with_empty_axes:
                return x
            axes = list(range(x.dim()))
        return fn(x, [_axis(a, x.dim()) for a in axes], keepdim=bool(keepdims))

    reduce.__name__ = f"reduce_{fn.__name__}"
    return reduce


reduce_mean = _reduce(torch.mean)
reduce_sum = _reduce(torch.sum)
reduce_max = _reduce(torch.amax)
reduce_min = _reduce(torch.amin)


def reduce_prod(x, axes_in=None, *, axes=None, keepdims: int = 1, noop_with_empty_axes: int = 0):
    axes = _optional_ints(axes_in) if axes_in is not None else axes
    if not axes:
        if noop_with_empty_axes:
            return x
        axes = list(range(x.dim()))
    for a in sorted((_axis(a, x.dim()) for a in axes), reverse=True):
        x = torch.prod(x, a, keepdim=bool(keepdims))
    return x


def reduce_l2(x, axes_in=None, *, axes=None, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return torch.sqrt(reduce_sum(x * x, axes_in, axes=axes, keepdims=keepdims,
                                 noop_with_empty_axes=noop_with_empty_axes))


def arg_max(x, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0):
    if select_last_index:
        flipped = x.flip(axis)
        return x.shape[axis] - 1 - torch.argmax(flipped, axis, keepdim=bool(keepdims))
    return torch.argmax(x, axis, keepdim=bool(keepdims))


def softmax(x, *, axis: int = -1):
    return torch.softmax(x, axis)


def log_softmax(x, *, axis: int = -1):
    return torch.log_softmax(x, axis)


_STASH_DTYPE = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64}


def layer_normalization(x, scale, bias=None, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1,
                        _n: int = 1):
    axis = _axis(axis, x.dim())
    if _n == 1 and x.dtype == scale.dtype:
        return F.layer_norm(x, x.shape[axis:], scale, bias, epsilon)
    xs = x.to(_STASH_DTYPE[stash_type])
    dims = list(range(axis, x.dim()))
    mean = xs.mean(dims, keepdim=True)
    inv_std = torch.rsqrt((xs - mean).pow(2).mean(dims, keepdim=True) + epsilon)
    y = ((xs - mean) * inv_std).to(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return (y, mean, inv_std)[:_n] if _n > 1 else y


def rms_normalization(x, scale, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1):
    # x / sqrt(mean(x²) + eps) · scale, with the statistics in the stash type (fp32 by default).
    axis = _axis(axis, x.dim())
    xs = x.to(_STASH_DTYPE[stash_type])
    dims = list(range(axis, x.dim()))
    y = xs * torch.rsqrt(xs.pow(2).mean(dims, keepdim=True) + epsilon)
    return y.to(x.dtype) * scale


def simplified_layer_normalization(x, scale, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1,
                                   _n: int = 1):
    y = rms_normalization(x, scale, axis=axis, epsilon=epsilon, stash_type=stash_type)
    if _n == 1:
        return y
    xs = x.to(_STASH_DTYPE[stash_type])
    dims = list(range(_axis(axis, x.dim()), x.dim()))
    return y, torch.rsqrt(xs.pow(2).mean(dims, keepdim=True) + epsilon)


def gemm(a, b, c=None, *, alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0):  # noqa: N803
    a = a.t() if transA else a
    b = b.t() if transB else b
    if c is None:
        return torch.mm(a, b) * alpha if alpha != 1.0 else torch.mm(a, b)
    if c.dim() == 0:
        c = c.reshape(1)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha)


def einsum(*xs, equation: str):
    return torch.einsum(equation, *xs)


# ---------------------------------------------------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How the converter calls one ONNX op."""

    fn: Callable[..., Any]
    list_inputs: tuple[int, ...] = ()  # input positions that, when constant, are passed as Python int lists
    scalar_inputs: tuple[int, ...] = ()  # input positions that, when a constant 0-d tensor, become a Python number
    wants_num_outputs: bool = False  # fn takes `_n`: how many outputs the node declares
    wants_device: bool = False  # fn creates a tensor from nothing and takes `device`
    host_output: bool = False  # fn returns a host (CPU) tensor whatever its inputs' device (Shape, Size)


def _binary(fn: Callable[[Any, Any], Any]) -> OpSpec:
    return OpSpec(fn, scalar_inputs=(0, 1))


_REDUCE = dict(list_inputs=(1,))

STANDARD_OPS: dict[str, OpSpec] = {
    # elementwise binary
    "Add": _binary(operator.add),
    "Sub": _binary(operator.sub),
    "Mul": _binary(operator.mul),
    "Div": _binary(div),
    "Pow": OpSpec(pow_, scalar_inputs=(1,)),
    "Mod": OpSpec(mod),
    "Equal": OpSpec(torch.eq),
    "Less": OpSpec(torch.lt),
    "LessOrEqual": OpSpec(torch.le),
    "Greater": OpSpec(torch.gt),
    "GreaterOrEqual": OpSpec(torch.ge),
    "And": OpSpec(torch.logical_and),
    "Or": OpSpec(torch.logical_or),
    "Xor": OpSpec(torch.logical_xor),
    "BitwiseAnd": OpSpec(torch.bitwise_and),
    "BitwiseOr": OpSpec(torch.bitwise_or),
    "Max": OpSpec(variadic(torch.maximum)),
    "Min": OpSpec(variadic(torch.minimum)),
    "Sum": OpSpec(variadic(operator.add)),
    "Mean": OpSpec(mean_),
    "Where": OpSpec(where),
    # elementwise unary
    "Not": OpSpec(torch.logical_not),
    "Neg": OpSpec(torch.neg),
    "Abs": OpSpec(torch.abs),
    "Sign": OpSpec(torch.sign),
    "Exp": OpSpec(torch.exp),
    "Log": OpSpec(torch.log),
    "Sqrt": OpSpec(torch.sqrt),
    "Reciprocal": OpSpec(torch.reciprocal),
    "Floor": OpSpec(torch.floor),
    "Ceil": OpSpec(torch.ceil),
    "Round": OpSpec(torch.round),
    "Sin": OpSpec(torch.sin),
    "Cos": OpSpec(torch.cos),
    "Tanh": OpSpec(torch.tanh),
    "Sigmoid": OpSpec(torch.sigmoid),
    "Erf": OpSpec(torch.erf),
    "Relu": OpSpec(torch.relu),
    "Softplus": OpSpec(F.softplus),
    "IsNaN": OpSpec(torch.isnan),
    "Gelu": OpSpec(gelu),
    "LeakyRelu": OpSpec(leaky_relu),
    "HardSigmoid": OpSpec(hard_sigmoid),
    "Clip": OpSpec(clip, scalar_inputs=(1, 2)),
    "Cast": OpSpec(cast),
    "CastLike": OpSpec(cast_like),
    "Identity": OpSpec(identity),
    "Dropout": OpSpec(dropout, wants_num_outputs=True),
    # shapes and indexing
    "Shape": OpSpec(shape, host_output=True),
    "Size": OpSpec(size, host_output=True),
    "Reshape": OpSpec(reshape, list_inputs=(1,)),
    "Flatten": OpSpec(flatten),
    "Transpose": OpSpec(transpose),
    "Squeeze": OpSpec(squeeze, list_inputs=(1,)),
    "Unsqueeze": OpSpec(unsqueeze, list_inputs=(1,)),
    "Concat": OpSpec(concat),
    "Split": OpSpec(split, list_inputs=(1,), wants_num_outputs=True),
    "Slice": OpSpec(slice_, list_inputs=(1, 2, 3, 4)),
    "Gather": OpSpec(gather, scalar_inputs=(1,)),
    "GatherElements": OpSpec(gather_elements),
    "GatherND": OpSpec(gather_nd),
    "ScatterND": OpSpec(scatter_nd),
    "ScatterElements": OpSpec(scatter_elements),
    "Expand": OpSpec(expand, list_inputs=(1,)),
    "Tile": OpSpec(tile, list_inputs=(1,)),
    "ConstantOfShape": OpSpec(constant_of_shape, list_inputs=(0,), wants_device=True),
    "Range": OpSpec(range_),
    "Trilu": OpSpec(trilu, scalar_inputs=(1,)),
    "Pad": OpSpec(pad, list_inputs=(1, 3), scalar_inputs=(2,)),
    "CumSum": OpSpec(cumsum, scalar_inputs=(1,)),
    # reductions, normalisations, matmuls
    "ReduceMean": OpSpec(reduce_mean, **_REDUCE),
    "ReduceSum": OpSpec(reduce_sum, **_REDUCE),
    "ReduceMax": OpSpec(reduce_max, **_REDUCE),
    "ReduceMin": OpSpec(reduce_min, **_REDUCE),
    "ReduceProd": OpSpec(reduce_prod, **_REDUCE),
    "ReduceL2": OpSpec(reduce_l2, **_REDUCE),
    "ArgMax": OpSpec(arg_max),
    "Softmax": OpSpec(softmax),
    "LogSoftmax": OpSpec(log_softmax),
    "LayerNormalization": OpSpec(layer_normalization, wants_num_outputs=True),
    "RMSNormalization": OpSpec(rms_normalization),
    "SimplifiedLayerNormalization": OpSpec(simplified_layer_normalization, wants_num_outputs=True),
    "MatMul": OpSpec(torch.matmul),
    "Gemm": OpSpec(gemm),
    "Einsum": OpSpec(einsum),
}

# ops whose meaning changed in a way these functions do not follow, with the first opset they do follow
MIN_OPSET = {"Softmax": 13, "LogSoftmax": 13, "Split": 13, "Squeeze": 11, "Unsqueeze": 11, "Slice": 10}
