"""What the ops' Triton kernels (face 4 of docs/architecture.md §4, plugins/<op>/kernel.py) share: the float dtypes
they take,
the row view they read [..., N] tensors through, block sizes rounded to powers of two, the launch option that keeps
their rounding exact, and the launcher of the gated pointwise kernels (SiluMul, GeluMul)."""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher

# The float dtypes a kernel is launched for → the Triton dtype its DTYPE constexpr names.
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [R, n] with a dense last axis: a view where it can be (a Split half of a contiguous tensor is
    one, with row stride 2n), else a contiguous copy."""
    view = t.reshape(-1, n)
    return view if view.stride(-1) == 1 else view.contiguous()


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for n >= 0 in plain int arithmetic: the Triton function is a constexpr function whose
    call wrapper costs ~2-4 µs of host time, and the launch wrappers call it several times per launch."""
    return (1 << (n - 1).bit_length()) if n > 0 else 0


def no_fp_fusion() -> dict[str, Any]:
    """Launch options that turn off FMA contraction (`enable_fp_fusion=False`): the unfused graph rounds every
    product before the sum, so a contracted multiply-add would round differently. The CPU interpreter
    (TRITON_INTERPRET=1) does not take the option."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def gated_slice(G, U, row, start, stride_g, stride_u, N, BLOCK: tl.constexpr):
    """Values start.. start + BLOCK of one row of gate and up as fp32 (zeros past N), for the gated kernels:
    (offsets, mask, gate, up)."""
    offs = start + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    return offs, m, g, u


@triton.jit
def gated_row(G, U, stride_g, stride_u, N, BLOCK: tl.constexpr):
    """A program's whole row of gate and up as fp32 (zeros past N), for the FP8 forms of the gated kernels:
    (row, offsets, mask, gate, up)."""
    row = tl.program_id(0).to(tl.int64)
    offs, m, g, u = gated_slice(G, U, row, 0, stride_g, stride_u, N, BLOCK)
    return row, offs, m, g, u


def launch_gated_fp8(kernel: Any, plain: Any, op: str, gate: torch.Tensor, up: torch.Tensor, *, min_scale: float,
                     act_scale: torch.Tensor | None,
                     **constexprs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """y = act(gate) · up quantized to FP8 per row instead of written, through the FP8 form of a gated row kernel
    (SiluMul's, GeluMul's), whose parameters are (G, U, Q, RS, S, stride_g, stride_u, N, MIN_SCALE, BLOCK, DTYPE,
    DYNAMIC, *constexprs): a program a row, shaped as the activation's quantize launch (plugins/qmatmul/gemm.py
    `quantize_launch_config`) → (codes [..., N] float8_e4m3fn, row scale [R, 1] fp32, y's dtype) under the static
    per-tensor act_scale, or (None) the dynamic per-token scale: bit for bit `plain` (the op's plain launcher)
    followed by the quantize launch (gemm.py `activation_fp8`), which is what rows longer than QUANTIZE_BLOCK_K
    values run."""
    from trtopt.plugins.qmatmul.gemm import QUANTIZE_BLOCK_K, activation_fp8, quantize_launch_config, static_scale_arg

    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in TL_DTYPES:
        raise ValueError(f"{op} needs gate and up of one shape and float dtype; got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    n = gate.shape[-1]
    if n > QUANTIZE_BLOCK_K:
        return activation_fp8(plain(gate, up), act_scale, min_scale)
    g, u = as_rows(gate, n), as_rows(up, n)
    codes = torch.empty(gate.shape, dtype=torch.uint8, device=gate.device)
    row_scale = torch.empty(g.shape[0], 1, dtype=torch.float32, device=gate.device)
    if g.shape[0] and n:
        block, warps = quantize_launch_config(n)
        launcher.launch(kernel, (g.shape[0],), g, u, codes, row_scale, static_scale_arg(act_scale, row_scale),
                        g.stride(0), u.stride(0), n, float(min_scale), BLOCK=block, DTYPE=TL_DTYPES[gate.dtype],
                        DYNAMIC=act_scale is None, **constexprs, num_warps=warps, **no_fp_fusion())
    return codes.view(torch.float8_e4m3fn), row_scale, gate.dtype


def launch_gated_xp(kernel: Any, plain: Any, op: str, gate: torch.Tensor, up: torch.Tensor, *, group: int,
                    **constexprs: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y = act(gate) · up and, in the same launch, y packed for the INT4 GEMV of a weight of quantization group
    `group`, through the xp form of a gated row kernel (SiluMul's, GeluMul's), whose parameters are (G, U, Y, XP,
    DOWN, stride_g, stride_u, N, BLOCK, DTYPE, *constexprs, K, GROUP, X_CHUNK, CHUNK_WORDS, ASM): a program a row,
    walking it in the plain launch's BLOCK-value slices with its math (the same y), then plugins/qmatmul/
    kernel_half2.py `pack_x_row` → (y, xpack, down). A step that does not run that GEMV (plugins/qmatmul/kernel.py
    `x_pack_outputs`) gets `plain` (the op's plain launcher) and (y, None, None)."""
    from trtopt.plugins.qmatmul.kernel import x_pack_outputs

    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in TL_DTYPES:
        raise ValueError(f"{op} needs gate and up of one shape and float dtype; got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    n = gate.shape[-1]
    g, u = as_rows(gate, n), as_rows(up, n)
    xpack, down, pack = x_pack_outputs(g.shape[0], n, group, gate.dtype, gate.device)
    if xpack is None:
        return plain(gate, up), None, None
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    launcher.launch(kernel, (g.shape[0],), g, u, out, xpack, down, g.stride(0), u.stride(0), n,
                    BLOCK=min(next_pow2(n), 4096), DTYPE=TL_DTYPES[gate.dtype], **constexprs, **pack, num_warps=4,
                    **no_fp_fusion())
    return out, xpack, down


def launch_gated(kernel: Any, op: str, gate: torch.Tensor, up: torch.Tensor, **constexprs: Any) -> torch.Tensor:
    """y = act(gate) · up through a gated row kernel (SiluMul's, GeluMul's), whose parameters are
    (G, U, Y, stride_g, stride_u, N, BLOCK, DTYPE, *constexprs): gate, up [..., N] of one shape and float dtype,
    possibly strided views with a dense last axis → a new contiguous y. One program per row and block of N."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in TL_DTYPES:
        raise ValueError(f"{op} needs gate and up of one shape and float dtype; got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g, u = as_rows(gate, n), as_rows(up, n)
    block = min(next_pow2(n), 4096)
    launcher.launch(kernel, (g.shape[0], -(-n // block)),
        g, u, out, g.stride(0), u.stride(0), n, BLOCK=block, DTYPE=TL_DTYPES[gate.dtype], **constexprs,
        num_warps=4 if block >= 1024 else 1, **no_fp_fusion(),
    )
    return out
