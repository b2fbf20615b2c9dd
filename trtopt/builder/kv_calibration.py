"""The calibrations of `trtopt build --kv-cache-smoothing` and `--kv-cache-scales amax` (docs/architecture.md §3):
every layer's mean post-RoPE key and value per KV head and channel, and their largest magnitude per KV head, read where
the fused plan graph hands them to PagedAttention.

The text is trtopt/quantize/data.py's calibration rule (the first windows of Python's reference manual, BOS in front
when the tokenizer starts every text with one; nothing is downloaded). Running the graph over them is the
``KvCalibrator``'s job, which the caller hands to build_plan: runtime/kv_calibration.py's `kv_stats` (what `trtopt
build` passes) runs the plan graph through the torch executor's converter on CUDA when torch sees a device, else on
the CPU, before its pools become FP8, one window a step from position 0, reading every PagedAttention's k and v
inputs as extra graph outputs that are removed again afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import numpy as np
import onnx_ir as ir

from trtopt.signature import FP8_E4M3_MAX

DEFAULT_WINDOWS = 8  # calibration windows ...
DEFAULT_WINDOW = 512  # ... of this many tokens (fewer when the plan's max_model_len is shorter)


@dataclasses.dataclass(frozen=True)
class KvStats:
    """Per layer (graph order), over ``tokens`` calibration tokens: the mean key and value, [Hkv, D] float64 each
    (``k``, ``v``), and the largest |key| and |value| per KV head, [Hkv] float64 each (``k_amax``, ``v_amax``)."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    k_amax: list[np.ndarray]
    v_amax: list[np.ndarray]
    tokens: int
    windows: int
    device: str
    seconds: float

    def fp8_scales(self) -> tuple[list[float], list[float]]:
        """Every layer's K and V scale for FP8 pools (`--kv-cache-scales amax`): its amax over all KV heads / 448,
        so the largest calibrated key or value lands on E4M3's largest finite value (1.0 where the layer saw only
        zeros)."""
        def scale(amax: np.ndarray) -> float:
            top = float(np.max(amax))
            return top / FP8_E4M3_MAX if top > 0 else 1.0

        return [scale(a) for a in self.k_amax], [scale(a) for a in self.v_amax]

    def head_factors(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every layer's K and V factors per KV head (`--kv-cache-scales amax_head`): [Hkv] powers of two,
        2^floor(log2(layer amax / head amax)), so each head's amax times its factor is within 2x of the layer's and
        never above it (the layer's own largest head gets 1, as does a head that saw only zeros)."""
        def factors(amax: np.ndarray) -> np.ndarray:
            top = float(np.max(amax))
            safe = np.where(amax > 0, amax, top if top > 0 else 1.0)
            f = np.exp2(np.floor(np.log2(np.maximum(top, 1e-300) / safe))).clip(1.0, None)
            return np.where(safe * f > top, f / 2, f).clip(1.0, None)  # (where log2 rounded up)

        return [factors(a) for a in self.k_amax], [factors(a) for a in self.v_amax]

    def describe(self) -> str:
        return (f"calibrated on {self.windows} x {self.tokens // max(self.windows, 1)} tokens of Python's reference "
                f"manual ({self.device}, {self.seconds:.1f} s)")


def calibration_windows(tokenizer, *, max_len: int, windows: int = DEFAULT_WINDOWS,
                        window: int = DEFAULT_WINDOW) -> np.ndarray:
    """[windows, L] token ids by data.py's calibration rule, L <= max_len counting the BOS data.with_bos adds."""
    from trtopt.quantize import data

    tokens = data.corpus_tokens(tokenizer)
    bos = data.with_bos(np.zeros((1, 0), np.int64), tokenizer).shape[1]
    length = min(window, max_len - bos)
    assert length > 0, f"max_model_len {max_len} leaves no room for a calibration window"
    return data.with_bos(data.split_windows(tokens, calibration=(windows, length)).calibration, tokenizer)


class KvCalibrator(Protocol):
    """What runs the paged graph over the calibration windows (``build_plan(kv_calibrator=...)``): the runtime's
    trtopt/runtime/kv_calibration.py `kv_stats`, which `trtopt build` passes. It lives above the builder because it
    executes the graph through the runtime's torch converter and input builder (the builder never imports them)."""

    def __call__(self, model: ir.Model, windows: np.ndarray, *, block_size: int,
                 on_window: Callable[[], None]) -> KvStats: ...
