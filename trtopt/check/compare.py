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
