"""Weight quantization numerics in numpy: FP8 per output channel, INT4 per group (RTN), clip search and AWQ.

A weight is the MatMul's B, ``W [K, N]`` (y = x @ W): FP8 scales are per output channel (one per column, DQ
axis=1) and INT4 scales are per block of ``group`` rows of one column (DQ axis=0, block_size=group), i.e. [K/G, N].
Every function returns the stored codes and scales *and* is matched by a dequantize that mirrors
ONNX DequantizeLinear exactly, so the graph and the fake-quant reference agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest float8e4m3fn
FP8 = ml_dtypes.float8_e4m3fn
_TINY = np.float32(2.0 ** -24)  # smallest scale we write: an all-zero channel still gets a positive scale
CLIP_GRID = 20  # clip ratios 1.0 down to 0.5
AWQ_GRID = 20  # alphas 0, 0.05, ..., 0.95 (alpha 0 is RTN: AWQ never loses to it on its own calibration loss)


@dataclass(frozen=True)
class QuantizedWeight:
    """The tensors a weight DequantizeLinear reads: ``codes`` (float8e4m3fn, int4 or uint4 as ml_dtypes arrays),
    ``scale`` ([N] for FP8, [K/G, N] for INT4) and the optional uint4 ``zero_point`` shaped like ``scale``."""

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    group: int | None  # None: per output channel (FP8)

    def dequantize(self) -> np.ndarray:
        """What DequantizeLinear computes: (codes - zero_point) * scale, as float32 [K, N]."""
        codes = self.codes.astype(np.float32)
        if self.group is None:
            return codes * self.scale[None, :]
        k, n = codes.shape
        shifted = codes.reshape(k // self.group, self.group, n)
        if self.zero_point is not None:
            shifted = shifted - self.zero_point.astype(np.float32)[:, None, :]
        return (shifted * self.scale[:, None, :]).reshape(k, n)


# ---- FP8 ------------------------------------------------------------------------------------------------------------


def fp8_round(x: np.ndarray) -> np.ndarray:
    """Saturating round to float8e4m3fn (QuantizeLinear's saturate=1), as float32."""
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(FP8).astype(np.float32)


def quantize_fp8(w: np.ndarray, *, clip_ratio: np.ndarray | None = None, dtype=np.float32) -> QuantizedWeight:
    """Per-output-channel FP8: scale[n] = ratio[n] * max|W[:, n]| / 448, cast to the model's ``dtype``."""
    amax = np.abs(w).max(axis=0)
    if clip_ratio is not None:
        amax = amax * clip_ratio
    scale = np.maximum(amax / FP8_MAX, _TINY).astype(dtype).astype(np.float32)
    codes = np.clip(w / scale[None, :], -FP8_MAX, FP8_MAX).astype(FP8)
    return QuantizedWeight(codes, scale, None, None)


def fp8_clip_search(w: np.ndarray, *, grid: int = CLIP_GRID, dtype=np.float32) -> np.ndarray:
    """Per-channel clip ratio in [0.5, 1] minimising the weight's FP8 rounding MSE (ratios [N])."""
    best = np.full(w.shape[1], np.inf)
    ratio = np.ones(w.shape[1], np.float32)
    for r in np.linspace(1.0, 0.5, grid):
        q = quantize_fp8(w, clip_ratio=np.full(w.shape[1], r, np.float32), dtype=dtype)
        err = ((w - q.dequantize()) ** 2).sum(axis=0)
        better = err < best
        best[better], ratio[better] = err[better], r
    return ratio


# ---- INT4 -----------------------------------------------------------------------------------------------------------


def quantize_int4(w: np.ndarray, group: int, *, symmetric: bool, clip_ratio: np.ndarray | None = None,
                  dtype=np.float32) -> QuantizedWeight:
    """Blocked INT4 over K: symmetric int4 in [-8, 7] with scale = amax/7, or asymmetric uint4 in [0, 15] with
    scale = (max - min)/15 and zero point round(-min/scale) (AWQ's convention). ``clip_ratio`` [K/G, N] shrinks the
    range before rounding."""
    k, n = w.shape
    assert k % group == 0, f"group {group} must divide K={k}"
    wg = w.reshape(k // group, group, n)
    ratio = 1.0 if clip_ratio is None else clip_ratio
    if symmetric:
        amax = np.abs(wg).max(axis=1) * ratio
        scale = np.maximum(amax / 7.0, _TINY).astype(dtype).astype(np.float32)
        codes = np.clip(np.round(wg / scale[:, None, :]), -8, 7)
        return QuantizedWeight(codes.reshape(k, n).astype(ml_dtypes.int4), scale, None, group)
    hi, lo = wg.max(axis=1) * ratio, wg.min(axis=1) * ratio
    scale = np.maximum((hi - lo) / 15.0, _TINY).astype(dtype).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    codes = np.clip(np.round(wg / scale[:, None, :]) + zero[:, None, :], 0, 15)
    return QuantizedWeight(codes.reshape(k, n).astype(ml_dtypes.uint4), scale, zero.astype(ml_dtypes.uint4), group)


def group_hessians(hessian: np.ndarray, group: int) -> np.ndarray:
    """The diagonal blocks of X^T X: [K/G, G, G] (the output error of one group of rows sees only its block)."""
    k = hessian.shape[0]
    idx = np.arange(k).reshape(k // group, group)
    return hessian[idx[:, :, None], idx[:, None, :]]


def int4_clip_search(w: np.ndarray, group: int, *, symmetric: bool, blocks: np.ndarray | None = None,
                     grid: int = CLIP_GRID, dtype=np.float32) -> np.ndarray:
    """Per-(group, column) clip ratio in [0.5, 1] minimising the group's error, weighted by the activations' group
    Hessian ``blocks`` [K/G, G, G] (the layer output's MSE) or unweighted (the weight MSE). Returns [K/G, N]."""
    k, n = w.shape
    wg = w.reshape(k // group, group, n)
    best = np.full((k // group, n), np.inf)
    ratio = np.ones((k // group, n), np.float32)
    for r in np.linspace(1.0, 0.5, grid):
        q = quantize_int4(w, group, symmetric=symmetric, clip_ratio=np.float32(r), dtype=dtype)
        e = wg - q.dequantize().reshape(wg.shape)  # [K/G, G, N]
        err = (e * (blocks @ e)).sum(axis=1) if blocks is not None else (e * e).sum(axis=1)
        better = err < best
        best[better], ratio[better] = err[better], r
    return ratio


# ---- AWQ ------------------------------------------------------------------------------------------------------------


def output_mse(error: np.ndarray, hessian: np.ndarray) -> float:
    """Mean squared output error of x @ error over the calibration tokens, from H = X^T X / tokens: tr(E^T H E)/N."""
    return float((error * (hessian @ error)).sum() / error.shape[1])


@dataclass(frozen=True)
class AwqScale:
    """The searched per-input-channel scale of the MatMuls sharing one activation (x / s) @ (s * W)."""

    alpha: float
    scale: np.ndarray  # s [K] float32
    rtn_mse: float  # the group's output MSE with s = 1
    awq_mse: float  # ... with the chosen s (before clip search)


def awq_search(weights: list[np.ndarray], mean_abs: np.ndarray, hessian: np.ndarray, quantize, *,
               grid: int = AWQ_GRID) -> AwqScale:
    """AWQ's scale search: s = mean|x|^alpha (normalised to geometric mean 1 of its extremes), alpha over a grid,
    minimising the summed output MSE of ``weights`` (each [K, N], one activation) after ``quantize(w) -> deq``."""
    best = None
    base = np.maximum(mean_abs.astype(np.float64), 1e-8)
    for alpha in np.arange(grid) / grid:
        s = base ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        loss = sum(output_mse(w - quantize(w * s[:, None]) / s[:, None], hessian) for w in weights)
        if best is None or loss < best[0]:
            best = (loss, float(alpha), s)
        if alpha == 0:
            rtn = loss
    loss, alpha, s = best
    return AwqScale(alpha, s, rtn, loss)
