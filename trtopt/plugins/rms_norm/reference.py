"""RMSNorm, face 3 of docs/architecture.md §4: the torch reference (fp32 math, output in x's dtype)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, *, epsilon: float) -> torch.Tensor:
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return scale * normalized.to(x.dtype)
