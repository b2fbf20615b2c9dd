"""QMatMul, face 3 of docs/architecture.md §4: the torch reference, dequantize then matmul in fp32.

Weights come as the torch executor loads them: FP8 as torch.float8_e4m3fn, INT4/UINT4 unpacked to one int8/uint8
per value (runtime/executors/onnx_to_torch.py). The activation Q/DQ is ONNX's: x / scale rounded to nearest even
into FP8 E4M3 with saturation to ±448, times scale.
"""

from __future__ import annotations

import torch

from trtopt.plugins.qmatmul.schema import ACT_NONE

FP8_MAX = 448.0


def dequantize_weight(w_q: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, *,
                      block_size: int) -> torch.Tensor:
    """DequantizeLinear of w_q [K, N] → fp32 [K, N]: per output channel (scale [N]) or blocked over K (scale
    [K/G, N])."""
    w = w_q.float()
    zp = w_zero_point.float()
    scale = w_scale.float()
    if block_size:
        zp, scale = zp.repeat_interleave(block_size, 0), scale.repeat_interleave(block_size, 0)
    return (w - zp) * scale


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DequantizeLinear(QuantizeLinear(x, scale) to FP8 E4M3, saturating) in fp32; scale broadcasts to x."""
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def qmatmul_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                act_scale: torch.Tensor, act_zero_point: torch.Tensor | None = None,
                act_quantized: torch.Tensor | None = None, act_static: torch.Tensor | None = None, *, axis: int = 1,
                block_size: int = 0, act_mode: int = ACT_NONE, act_block_size: int = 0,
                weight_dtype: int = 0) -> torch.Tensor:
    # x: [..., K], w_q: [K, N] → y: [..., N] in x's dtype. act_quantized/act_static restate act_mode for the
    # function body's Ifs; the attribute decides here (no host sync on a flag tensor).
    w = dequantize_weight(w_q, w_scale, w_zero_point, block_size=block_size)
    xf = x.float()
    if act_mode != ACT_NONE:
        xf = fake_quantize_fp8(xf, act_scale.float())
    return (xf @ w).to(x.dtype)
