"""Tolerances and error statistics of `trtopt check`, with Polygraphy's element-wise semantics.

An element of ``got`` mismatches its reference ``ref`` when its absolute error exceeds ``atol`` AND its relative
error ``|got - ref| / |ref|`` exceeds ``rtol`` (a NaN error always mismatches), as `polygraphy run
--check-error-stat elemwise` does; a tensor passes when no element mismatches. Reported max abs / max rel errors
are then the smallest tolerances that would pass alone (Polygraphy's "minimum required tolerance").

Default tolerances per plan dtype (the logits are always float32; the attention outputs have the plan's dtype):

| dtype    | atol | rtol | why |
|----------|------|------|-----|
| float32  | 1e-4 | 1e-4 | the project's bar for a fused graph against the original on ORT; two fp32 backends differ ~1e-5 |
| float16  | 5e-2 | 1e-2 | ~10 bits of mantissa through every layer, then logits of magnitude ~10 |
| bfloat16 | 2.5e-1 | 5e-2 | ~7 bits of mantissa: 8x float16's spacing |
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trtopt.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


DEFAULT_TOLERANCES = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=5e-2, rtol=1e-2),
    "bfloat16": Tolerance(atol=2.5e-1, rtol=5e-2),
}
_EPS = float(np.finfo(np.float64).eps)  # added to zero references so that their relative error is finite


def tolerance_for(dtype: str, *, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The default tolerance of a plan dtype, with either bound overridden."""
    if dtype not in DEFAULT_TOLERANCES:
        raise ConfigError(f"no default tolerance for dtype {dtype!r}; pass --atol and --rtol.")
    default = DEFAULT_TOLERANCES[dtype]
    tol = Tolerance(default.atol if atol is None else atol, default.rtol if rtol is None else rtol)
    if tol.atol < 0 or tol.rtol < 0:
        raise ConfigError(f"tolerances must be >= 0; got atol={tol.atol}, rtol={tol.rtol}.")
    return tol


@dataclasses.dataclass
class ErrorStats:
    """Errors of one kind of tensor (the logits, or one layer's attention output) over every compared step."""

    tolerance: Tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    sum_abs: float = 0.0
    elements: int = 0
    mismatched: int = 0  # elements over both tolerances (or NaN)

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        assert got.shape == ref.shape, f"compared tensors differ in shape: {got.shape} vs {ref.shape}"
        got, ref = got.astype(np.float64), ref.astype(np.float64)
        absdiff = np.abs(got - ref)
        reldiff = absdiff / np.where(ref == 0, _EPS, np.abs(ref))
        bad = ((absdiff > self.tolerance.atol) | np.isnan(absdiff)) & ((reldiff > self.tolerance.rtol) | np.isnan(reldiff))
        self.mismatched += int(bad.sum())
        self.elements += absdiff.size
        finite = ~np.isnan(absdiff)  # NaNs are counted as mismatches above; the maxima are over the rest
        if finite.any():
            self.max_abs = max(self.max_abs, float(absdiff[finite].max()))
            self.max_rel = max(self.max_rel, float(reldiff[finite].max()))
            self.sum_abs += float(absdiff[finite].sum())

    @property
    def passed(self) -> bool:
        return self.mismatched == 0

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.elements if self.elements else 0.0

    def to_dict(self) -> dict:
        return {"passed": self.passed, "max_abs": self.max_abs, "max_rel": self.max_rel, "mean_abs": self.mean_abs,
                "mismatched": self.mismatched, "elements": self.elements}


# ---- a quantized plan against its float original --------------------------------------------------------------------
# Elementwise bars measure rounding; quantization changes every logit on purpose. What matters is whether the
# distribution over the next token survives, so the bar is on that (llama.cpp's KL-divergence statistics, and the
# agreement and log-prob drift that ModelOpt/Polygraphy users read): per position, with p = softmax(reference) and
# q = softmax(quantized), and a the reference's argmax,
#   top-1 agreement  argmax q == a, as a rate over every compared position
#   KL               sum p (log p - log q) in nats: its mean over positions, and its max
#   Δ logprob        |log q(a) - log p(a)|: its max over positions (how far the reference's choice fell)
# Defaults: a sane quantization of a small model passes, a broken one does not. SmolLM2-135M FP8 W8A8 (static) on the
# default text workload: top-1 0.94, mean KL 0.038, max |Δ logprob| 0.67 (README, Quantization); top-1 over 1,024
# calibration positions is 0.89, hence 0.85. The KL bar is the one that matters: mean KL ~ Δ log-perplexity.


@dataclasses.dataclass(frozen=True)
class QuantTolerance:
    """The bar for a quantized plan against its float original (`trtopt check FP_EXPORT QUANT_PLAN`)."""

    min_top1: float = 0.85  # top-1 agreement rate over positions
    max_kl: float = 0.1  # mean KL(reference || quantized), nats
    max_dlogprob: float = 3.0  # max |Δ log-prob| of the reference's argmax, nats

    def check(self) -> None:
        if not 0.0 <= self.min_top1 <= 1.0:
            raise ConfigError(f"--min-top1 is a rate in [0, 1]; got {self.min_top1}.")
        if self.max_kl < 0 or self.max_dlogprob < 0:
            raise ConfigError(f"--max-kl and --max-dlogprob must be >= 0; got {self.max_kl}, {self.max_dlogprob}.")

    def to_dict(self) -> dict:
        return {"check": "quantization", **dataclasses.asdict(self)}


@dataclasses.dataclass
class QuantStats:
    """The quantization metrics of one side's logits over every compared position (rows of [n, vocab])."""

    tolerance: QuantTolerance = QuantTolerance()
    positions: int = 0
    top1_same: int = 0
    sum_kl: float = 0.0
    max_kl: float = 0.0
    max_dlogprob: float = 0.0
    nonfinite: int = 0  # positions whose quantized logits hold a NaN or inf (each fails the check)

    def add(self, got: np.ndarray, ref: np.ndarray | ReferenceLogits) -> None:
        """Compare the rows of ``got`` with ``ref`` (logits, or ReferenceLogits when compared again and again)."""
        ref = ref if isinstance(ref, ReferenceLogits) else ReferenceLogits.of(ref)
        got = got.reshape(-1, got.shape[-1]).astype(np.float32, copy=False)
        assert got.shape == ref.logits.shape, f"compared logits differ in shape: {got.shape} vs {ref.logits.shape}"
        finite = np.isfinite(got).all(axis=-1)
        self.nonfinite += int((~finite).sum())
        self.positions += len(got)
        if not finite.all():
            got, ref = got[finite], ref.rows(finite)
        if not len(got):
            return
        lse = _logsumexp(got)
        # KL = sum p (log p - log q) = sum p (ref - got) - (lse_ref - lse_got), as sum p = 1
        kl = (ref.probs * (ref.logits - got)).sum(axis=-1, dtype=np.float64) - (ref.lse - lse)
        kl = np.maximum(kl, 0.0)  # rounding can leave -1e-9 where the two agree
        rows = np.arange(len(got))
        dlogprob = (got[rows, ref.top] - lse) - (ref.logits[rows, ref.top] - ref.lse)
        self.top1_same += int((got.argmax(axis=-1) == ref.top).sum())
        self.sum_kl += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max()))
        self.max_dlogprob = max(self.max_dlogprob, float(np.abs(dlogprob).max()))

    @property
    def top1_agreement(self) -> float:
        return self.top1_same / self.positions if self.positions else 1.0

    @property
    def mean_kl(self) -> float:
        finite = self.positions - self.nonfinite
        return self.sum_kl / finite if finite else (0.0 if not self.positions else float("inf"))

    @property
    def passed(self) -> bool:
        tol = self.tolerance
        return (self.nonfinite == 0 and self.top1_agreement >= tol.min_top1 and self.mean_kl <= tol.max_kl
                and self.max_dlogprob <= tol.max_dlogprob)

    def failures(self) -> list[str]:
        """Each bound this side misses, as the report says it."""
        tol, out = self.tolerance, []
        if self.nonfinite:
            out.append(f"{self.nonfinite} positions with non-finite logits")
        if self.top1_agreement < tol.min_top1:
            out.append(f"top-1 agreement {self.top1_agreement:.3f} < {tol.min_top1:g}")
        if self.mean_kl > tol.max_kl:
            out.append(f"mean KL {self.mean_kl:.3g} > {tol.max_kl:g}")
        if self.max_dlogprob > tol.max_dlogprob:
            out.append(f"max |Δlogprob| {self.max_dlogprob:.3g} > {tol.max_dlogprob:g}")
        return out

    def to_dict(self) -> dict:
        return {"passed": self.passed, "top1_agreement": self.top1_agreement, "mean_kl": self.mean_kl,
                "max_kl": self.max_kl, "max_dlogprob": self.max_dlogprob, "positions": self.positions,
                "nonfinite": self.nonfinite}


def new_stats(tolerance: Tolerance | QuantTolerance) -> ErrorStats | QuantStats:
    """The statistics a tolerance is checked on: elementwise errors, or the quantization metrics."""
    return QuantStats(tolerance) if isinstance(tolerance, QuantTolerance) else ErrorStats(tolerance)


@dataclasses.dataclass(frozen=True)
class ReferenceLogits:
    """Reference logits [n, vocab] with what every comparison reads: softmax, log-sum-exp and argmax per row."""

    logits: np.ndarray  # float32
    probs: np.ndarray  # float32
    lse: np.ndarray  # [n] float64
    top: np.ndarray  # [n] int

    @classmethod
    def of(cls, logits: np.ndarray) -> ReferenceLogits:
        logits = logits.reshape(-1, logits.shape[-1]).astype(np.float32, copy=False)
        lse = _logsumexp(logits)
        probs = np.exp(logits - lse[:, None].astype(np.float32))
        return cls(logits, probs, lse, logits.argmax(axis=-1))

    def rows(self, keep: np.ndarray) -> ReferenceLogits:
        return ReferenceLogits(self.logits[keep], self.probs[keep], self.lse[keep], self.top[keep])


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Per row of float32 ``x``, in float64 (exp in float32: the sum is what needs the precision)."""
    top = x.max(axis=-1, keepdims=True)
    return top[:, 0].astype(np.float64) + np.log(np.exp(x - top).sum(axis=-1, dtype=np.float64))
