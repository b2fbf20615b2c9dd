"""AddRMSNorm, face 3 of docs/architecture.md §4: the torch reference, the unfused Add then trtopt::RMSNorm's reference
(bit-identical to the two ops it replaces on the torch executor's CPU path; with an fp32 scale and half-precision
inputs, to the Add, the upcast Cast and the fp32 RMSNorm)."""

from __future__ import annotations

import torch

from trtopt.plugins.rms_norm.reference import rms_norm_ref


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, *,
                     epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_ref(s.to(torch.promote_types(s.dtype, scale.dtype)), scale, epsilon=epsilon), s
