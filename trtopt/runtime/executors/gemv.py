"""Decode-sized projections through Triton GEMVs (opt-in: `TorchExecutor(small_m_gemv=True)`; issue 11).

On top of `fx_fusions.linear_weights` (every constant MatMul weight stored [N, K] and run as F.linear), this
rewrites the converted fx graph so that, on CUDA, a projection of at most `gemv_kernel.MAX_ROWS` rows runs
runtime/gemv_kernel.py's GEMV, and the gate/up projection feeding trtopt.SiluMul runs as one GEMV with SiLU·mul as
its epilogue (one launch instead of two). Larger steps, the CPU and anything off the kernels' preconditions (a bias,
a non-contiguous row, a Split that is not two halves of the last axis) run the F.linear path unchanged, so a CUDA
graph bucket picks one path by its shape alone.

Numbers differ from cuBLAS in accumulation order only; whether the kernels are faster is measured by
benchmarks/bench_projection_layout.py and gpu_e2e's `with_small_m_gemv` row, not assumed.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx
import torch.nn.functional as F

from trtopt.runtime.executors import onnx_ops, trtopt_ops
from trtopt.runtime.executors.fx_fusions import recompiled, replace_node

MAX_ROWS = 8  # gemv_kernel.MAX_ROWS, kept here so that importing this module does not import triton


@functools.cache
def _kernels():
    try:
        from trtopt.runtime import gemv_kernel
    except ImportError:  # no Triton: F.linear is always correct
        return None
    assert gemv_kernel.MAX_ROWS == MAX_ROWS
    return gemv_kernel


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x as [M, K] when the GEMV kernels can take it (CUDA, M <= MAX_ROWS, one dtype, K contiguous), else None."""
    if not (x.is_cuda and x.dtype == weight.dtype and x.shape[-1] == weight.shape[1] and x.stride(-1) == 1):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if 0 < rows.shape[0] <= MAX_ROWS and rows.stride(-1) == 1 and _kernels() is not None else None


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV kernel for a few rows on CUDA (without a bias)."""
    rows = _rows(x, weight) if bias is None else None
    if rows is None:
        return F.linear(x, weight, bias)
    return _kernels().gemv_triton(rows, weight).reshape(*x.shape[:-1], weight.shape[0])


def small_m_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, *, sizes: list[int], axis: int) -> torch.Tensor:
    """silu_mul(*split(F.linear(x, weight), sizes, axis)): one fused GEMV for a few rows on CUDA when the Split is
    gate and up as two halves of the last axis; otherwise exactly those three ops."""
    halves = len(sizes) == 2 and sizes[0] == sizes[1] and 2 * sizes[0] == weight.shape[0]
    rows = _rows(x, weight) if halves and axis in (-1, x.dim() - 1) else None
    if rows is None:
        gate, up = onnx_ops.split(F.linear(x, weight), sizes, axis=axis, _n=2)
        return trtopt_ops.silu_mul(gate, up)
    return _kernels().gemv_silu_mul_triton(rows, weight).reshape(*x.shape[:-1], sizes[0])


def _constant_linear(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is F.linear
            and isinstance(node.args[1], torch.fx.Node) and node.args[1].op == "get_attr")


def use_small_m_gemv(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Rewrite F.linear nodes of constant weights (run `fx_fusions.linear_weights` first) into `small_m_linear`, and
    F.linear → Split → SiluMul into `small_m_linear_silu_mul`. Returns (projections, gate/up + SiLU·mul fused)."""
    fused = 0
    for silu in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is trtopt_ops.silu_mul]:
        gate, up = silu.args[:2]
        if not all(isinstance(g, torch.fx.Node) and g.target is operator.getitem
                   and len(g.users) == 1 for g in (gate, up)):
            continue
        split = gate.args[0]
        if not (up.args[0] is split and (gate.args[1], up.args[1]) == (0, 1) and split.target is onnx_ops.split
                and len(split.users) == 2 and _constant_linear(split.args[0]) and len(split.args[0].users) == 1
                and len(split.args[0].args) == 2):
            continue
        sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split")
        if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and all(isinstance(s, int) for s in sizes)):
            continue
        linear = split.args[0]
        replace_node(gm, silu, small_m_linear_silu_mul, (linear.args[0], linear.args[1]),
                     {"sizes": list(sizes), "axis": split.kwargs.get("axis", 0)}, dead=(gate, up, split, linear))
        fused += 1
    projections = 0
    for node in [n for n in gm.graph.nodes if _constant_linear(n)]:
        node.target = small_m_linear
        projections += 1
    recompiled(gm, fused + projections)
    return projections, fused
