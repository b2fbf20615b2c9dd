"""SiluMul, face 3 of docs/architecture.md §4: the torch reference, bit-identical to the unfused graph's ops.

sigmoid(gate), then · gate, then · up, each rounded to the dtype like the exported Sigmoid → Mul → Mul (IEEE
multiplication commutes, so sigmoid·gate is gate·sigmoid). The two products are written in place into the
sigmoid's buffer: one allocation where the unfused graph makes three, which is what the CPU path gains.
"""

from __future__ import annotations

import torch


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(gate).mul_(gate).mul_(up)
