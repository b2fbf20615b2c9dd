"""A stand-in for the part of ``tensorrt.plugin`` that trtopt's trt_plugin modules use, for tests without TensorRT.

It mirrors the documented surface (NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin): register and
aot_impl decorators, TensorDesc (dtype, shape_expr, ndim, like, aliased), ShapeExpr arithmetic with is_constant /
constant_value, cdiv, KernelLaunchParams, SymInt32, SymIntExprs.from_tuple. Shape expressions carry a concrete
value (the shape TensorRT would resolve at enqueue) so tests can evaluate grids and extra args; ``constant`` marks
the dims TensorRT knows at build time. Install with ``install()`` before importing a trt_plugin module.
"""

import sys
import types
from typing import Any, Callable

REGISTERED: dict[str, Callable] = {}
AOT_IMPLS: dict[str, Callable] = {}


class DataType:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


class ShapeExpr:
    def __init__(self, value: int, constant: bool = False) -> None:
        self.value, self._constant = value, constant

    def _op(self, other: Any, fn: Callable[[int, int], int]) -> "ShapeExpr":
        if isinstance(other, ShapeExpr):
            return ShapeExpr(fn(self.value, other.value), self._constant and other._constant)
        assert isinstance(other, int), f"ShapeExpr op with {type(other)}"
        return ShapeExpr(fn(self.value, other), self._constant)

    def __add__(self, other: Any) -> "ShapeExpr":
        return self._op(other, lambda a, b: a + b)

    def __sub__(self, other: Any) -> "ShapeExpr":
        return self._op(other, lambda a, b: a - b)

    def __mul__(self, other: Any) -> "ShapeExpr":
        return self._op(other, lambda a, b: a * b)

    def __floordiv__(self, other: Any) -> "ShapeExpr":
        return self._op(other, lambda a, b: a // b)

    @property
    def is_constant(self) -> bool:
        return self._constant

    def constant_value(self) -> int:
        assert self._constant, "constant_value() of a dynamic dim"
        return self.value


class TensorDesc:
    def __init__(self, dtype: str, dims: list[tuple[int, bool]]) -> None:
        self.dtype = DataType(dtype)
        self.shape_expr = [ShapeExpr(v, c) for v, c in dims]
        self.aliased_to = None

    @property
    def ndim(self) -> int:
        return len(self.shape_expr)

    def like(self) -> "TensorDesc":
        clone = TensorDesc(self.dtype.name, [(d.value, d.is_constant) for d in self.shape_expr])
        return clone

    def aliased(self) -> "TensorDesc":
        clone = self.like()
        clone.aliased_to = self
        return clone


class SymInt32:
    def __init__(self, value: Any) -> None:
        self.value = value.value if isinstance(value, (ShapeExpr, SymInt32)) else value
        assert isinstance(self.value, int), f"SymInt32 of {type(value)}"


class SymExprs(list):
    """Stands in for trtp.SymIntExprs: a list of SymInt32."""


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, exprs: list) -> "SymIntExprs":
        assert all(isinstance(e, SymInt32) for e in exprs), "extra args must be SymInt32"
        return cls(exprs)


class KernelLaunchParams:
    _FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self) -> None:
        for name in self._FIELDS:
            object.__setattr__(self, name, SymInt32(0 if name == "shared_mem" else 1))

    def __setattr__(self, name: str, value: Any) -> None:
        assert name in self._FIELDS, f"KernelLaunchParams has no attribute {name!r}"
        object.__setattr__(self, name, SymInt32(value))


def cdiv(a: Any, b: Any) -> ShapeExpr:
    assert not (isinstance(a, int) and isinstance(b, int)), "cdiv of two ints"
    a = a if isinstance(a, ShapeExpr) else ShapeExpr(a, True)
    return a._op(b, lambda x, y: -(-x // y))


def register(plugin_id: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        REGISTERED[plugin_id] = fn
        return fn
    return decorator


def aot_impl(plugin_id: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        assert plugin_id in REGISTERED, f"{plugin_id} is not registered"
        AOT_IMPLS[plugin_id] = fn
        return fn
    return decorator


def install() -> types.ModuleType:
    """Put this module in sys.modules as ``tensorrt.plugin`` (and an empty ``tensorrt``)."""
    trt = types.ModuleType("tensorrt")
    plugin = sys.modules[__name__]
    trt.plugin = plugin
    sys.modules["tensorrt"] = trt
    sys.modules["tensorrt.plugin"] = plugin
    return plugin
