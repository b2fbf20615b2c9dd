"""MatMulAdd, face 3 of docs/architecture.md §4: the torch reference."""

from __future__ import annotations

import torch


def matmul_add_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # x: [..., K], weight: [K, N], bias: [N]
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[1])
