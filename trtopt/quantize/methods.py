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
GPTQ_DAMP = 0.01  # GPTQ adds this fraction of mean(diag H) to diag H (H is singular for dead inputs)
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


def fp8_clip_search(w: np.ndarray, *, hessian: np.ndarray | None = None, grid: int = CLIP_GRID,
                    dtype=np.float32) -> np.ndarray:
    """Per-channel clip ratio in [0.5, 1] minimising the FP8 rounding error of each column: weighted by the diagonal
    of the input's ``hessian`` [K, K] (mean x_k^2: the layer output's MSE without the cross terms, which cost K^2 N
    per ratio and change little on FP8's fine grid) or unweighted (the weight MSE). Ratios [N]."""
    best = np.full(w.shape[1], np.inf)
    ratio = np.ones(w.shape[1], np.float32)
    weight = np.ones((w.shape[0], 1), np.float32) if hessian is None else np.diag(hessian).astype(np.float32)[:, None]
    for r in np.linspace(1.0, 0.5, grid):
        q = quantize_fp8(w, clip_ratio=np.full(w.shape[1], r, np.float32), dtype=dtype)
        e = w - q.dequantize()
        err = (weight * e * e).sum(axis=0)
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


# ---- GPTQ -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptqFactor:
    """What GPTQ needs from one input's Hessian, computed once for every MatMul that reads that input."""

    order: np.ndarray  # [K] rows by decreasing diag(H) ("act order"; free for per-output-channel/-group scales)
    hinv: np.ndarray  # [K, K] float32, upper Cholesky factor of (H + damp)^-1 in that order
    dead: np.ndarray  # [K] bool, inputs that are always 0 (their rows round to 0)


def gptq_factor(hessian: np.ndarray, *, damp: float = GPTQ_DAMP) -> GptqFactor:
    h = hessian.astype(np.float64)  # copy
    k = h.shape[0]
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    order = np.argsort(-np.diag(h), kind="stable")
    h = h[np.ix_(order, order)]
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)
    return GptqFactor(order, hinv, dead)


def gptq_round(w: np.ndarray, factor: GptqFactor, round_row, *, block: int = 128) -> np.ndarray:
    """GPTQ's rounding (Frantar et al. 2022) with the scales already fixed: rows of ``w`` [K, N] (input channels) are
    rounded one at a time and each row's rounding error is spread over the rows not yet rounded, so that the output
    error tr(E^T H E) stays small. ``round_row(values [N], k) -> dequantized [N]`` rounds row ``k`` onto the format's
    grid; the result [K, N] float32 is on that grid row by row."""
    k = w.shape[0]
    order, hinv = factor.order, factor.hinv
    w = np.where(factor.dead[:, None], 0.0, w).astype(np.float32)[order]
    out = np.empty_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err = w[i1:i2].copy(), np.zeros((i2 - i1, w.shape[1]), np.float32)
        for i in range(i2 - i1):
            out[i1 + i] = round_row(w1[i], int(order[i1 + i]))
            err[i] = (w1[i] - out[i1 + i]) / hinv[i1 + i, i1 + i]
            w1[i + 1:] -= np.outer(hinv[i1 + i, i1 + i + 1:i2], err[i])
        w[i2:] -= hinv[i1:i2, i2:].T @ err
    result = np.empty_like(out)
    result[order] = out
    return result


def gptq_fp8(w: np.ndarray, hessian: np.ndarray, *, clip_ratio: np.ndarray | None = None,
             factor: GptqFactor | None = None, dtype=np.float32) -> QuantizedWeight:
    """Per-output-channel FP8 with the scales of ``quantize_fp8`` and GPTQ's error-compensating rounding."""
    nearest = quantize_fp8(w, clip_ratio=clip_ratio, dtype=dtype)
    scale = nearest.scale
    deq = gptq_round(w, factor or gptq_factor(hessian), lambda row, _k: fp8_round(row / scale) * scale)
    codes = np.clip(deq / scale[None, :], -FP8_MAX, FP8_MAX).astype(FP8)
    keep = _nearest_wins(w, nearest.dequantize(), deq, hessian)
    codes[:, keep] = nearest.codes[:, keep]
    return QuantizedWeight(codes, scale, None, None)


def gptq_int4(w: np.ndarray, group: int, hessian: np.ndarray, *, symmetric: bool,
              clip_ratio: np.ndarray | None = None, factor: GptqFactor | None = None, dtype=np.float32
              ) -> QuantizedWeight:
    """Blocked INT4 with the scales (and zero points) of ``quantize_int4`` and GPTQ's error-compensating rounding."""
    ref = quantize_int4(w, group, symmetric=symmetric, clip_ratio=clip_ratio, dtype=dtype)
    zero = np.zeros_like(ref.scale) if ref.zero_point is None else ref.zero_point.astype(np.float32)
    lo, hi = (-8, 7) if symmetric else (0, 15)

    def round_row(row: np.ndarray, k: int) -> np.ndarray:
        s, z = ref.scale[k // group], zero[k // group]
        return (np.clip(np.round(row / s) + z, lo, hi) - z) * s

    deq = gptq_round(w, factor or gptq_factor(hessian), round_row)
    k, n = w.shape
    codes = np.round(deq.reshape(k // group, group, n) / ref.scale[:, None, :]) + zero[:, None, :]
    codes = np.clip(codes, lo, hi).reshape(k, n).astype(ref.codes.dtype)
    keep = _nearest_wins(w, ref.dequantize(), deq, hessian)
    codes[:, keep] = ref.codes[:, keep]
    return QuantizedWeight(codes, ref.scale, ref.zero_point, group)


def _nearest_wins(w: np.ndarray, nearest: np.ndarray, gptq: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """Columns [N] bool where nearest rounding has the lower output error e^T H e than GPTQ's. Columns are
    independent (GPTQ spreads a column's error over that column only), so taking the better one per column makes
    GPTQ never worse than round-to-nearest with the same scales on the calibration loss."""
    err = lambda deq: ((w - deq) * (hessian @ (w - deq))).sum(axis=0, dtype=np.float64)  # noqa: E731
    return err(nearest) < err(gptq)
