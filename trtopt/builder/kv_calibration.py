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
# `--kv-cache-scales search`: each layer's candidate scales are amax / 448 times SEARCH_HEADROOM times 2^(i / SEARCH_STEPS)
# for i < SEARCH_STEPS. E4M3 rounds x / s and x / 2s alike (a power of two moves only the exponent), so one binade of
# candidates holds every rounding pattern a scale can give; the headroom keeps held-out values up to 2x the
# calibration's amax from saturating.
SEARCH_STEPS = 16
SEARCH_HEADROOM = 2.0


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
    # with scale candidates (`--kv-cache-scales search`): per layer, [C] squared attention-output errors of each
    # candidate K (V) scale over the windows (runtime/kv_calibration.py kv_stats)
    k_errors: list[np.ndarray] = dataclasses.field(default_factory=list)
    v_errors: list[np.ndarray] = dataclasses.field(default_factory=list)

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

    def scale_candidates(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every layer's candidate K and V scales for `--kv-cache-scales search`, [SEARCH_STEPS] each."""
        grid = SEARCH_HEADROOM * np.exp2(np.arange(SEARCH_STEPS) / SEARCH_STEPS)
        k, v = self.fp8_scales()
        return [s * grid for s in k], [s * grid for s in v]

    def searched_scales(self, candidates: tuple[list[np.ndarray], list[np.ndarray]]) -> tuple[list[float], list[float]]:
        """Every layer's K and V scale: the candidate whose rounding cost the attention output least over the
        calibration windows (k_errors / v_errors, measured by a calibration run given ``candidates``)."""
        assert len(self.k_errors) == len(candidates[0]) and len(self.v_errors) == len(candidates[1]), (
            "the calibration ran without these candidates")
        return ([float(c[int(np.argmin(e))]) for c, e in zip(candidates[0], self.k_errors)],
                [float(c[int(np.argmin(e))]) for c, e in zip(candidates[1], self.v_errors)])

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

    def __call__(self, model: ir.Model, windows: np.ndarray, *, block_size: int, on_window: Callable[[], None],
                 scale_candidates: tuple[list[np.ndarray], list[np.ndarray]] | None = None) -> KvStats: ...
