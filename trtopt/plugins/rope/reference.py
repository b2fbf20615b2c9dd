"""Rope, face 3 of docs/architecture.md §4: the torch reference, the exported ops' arithmetic (bit-identical to them
on CPU;
the torch executor's fx rewrite fell back to these same ops)."""

from __future__ import annotations

import torch


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, half: int = 0) -> torch.Tensor:
    h = half or x.shape[-1] // 2  # the graph's int64 Div truncates; on a size that is floor
    return x * cos + torch.cat((torch.neg(x[..., h:]), x[..., :h]), -1) * sin
