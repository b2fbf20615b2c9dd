"""Calibration: run the float export on ORT over the calibration text and collect, at every quantized MatMul's
input, the statistics the methods need (absmax for static FP8 activation scales; mean |x| per channel and
H = X^T X / tokens for AWQ and the output-weighted clip search)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx


@dataclass(frozen=True)
class ActivationStats:
    """One activation tensor over all calibration tokens (x: [tokens, K])."""

    absmax: float
    mean_abs: np.ndarray  # [K] float32
    hessian: np.ndarray | None  # [K, K] float32, X^T X / tokens; None when not asked for
    tokens: int


def calibrate(model: onnx.ModelProto, tensors: Sequence[str], sequences: np.ndarray, *, hessian: bool,
              threads: int = 2, progress: bool = False) -> dict[str, ActivationStats]:
    """Statistics of ``tensors`` (MatMul inputs of ``model``) over ``sequences`` [n, L] of token ids, each run from an
    empty KV cache."""
    from trtopt.quantize.runner import OrtCausalLM, with_outputs

    names = list(dict.fromkeys(tensors))
    lm = OrtCausalLM(with_outputs(model, names), threads=threads)
    absmax = {n: 0.0 for n in names}
    sum_abs: dict[str, np.ndarray] = {}
    gram: dict[str, np.ndarray] = {}
    tokens = 0
    with _progress(progress) as bar:
        task = bar.add_task("calibrating", total=len(sequences)) if bar else None
        for seq in sequences:
            values = lm.run(seq.tolist(), outputs=names)
            for name in names:
                x = values[name].reshape(-1, values[name].shape[-1]).astype(np.float32)  # [L, K]
                absmax[name] = max(absmax[name], float(np.abs(x).max()))
                sum_abs[name] = sum_abs.get(name, 0.0) + np.abs(x).sum(axis=0, dtype=np.float64)
                if hessian:
                    gram[name] = gram.get(name, 0.0) + (x.T @ x).astype(np.float64)
            tokens += seq.size
            if bar:
                bar.advance(task)
    return {n: ActivationStats(absmax[n], (sum_abs[n] / tokens).astype(np.float32),
                               (gram[n] / tokens).astype(np.float32) if hessian else None, tokens) for n in names}


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
