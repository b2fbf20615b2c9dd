"""Gate and up inputs for the gated-activation kernel tests (SiLU·mul, GELU·mul)."""

from __future__ import annotations

import torch


def gate_up_inputs(shape, dtype, device, seed=0, split=False, *, gate_scale: float):
    """(gate, up) of ``shape``: gate ~ N(0, gate_scale²) (reaching the activation's curved range), up ~ N(0, 1).
    ``split``: the two halves of the horizontal gate/up MatMul's Split, i.e. strided views."""
    gen = torch.Generator().manual_seed(seed)
    if split:
        g, u = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * gate_scale).split(shape[-1], dim=-1)
    else:
        g, u = torch.randn(*shape, generator=gen) * gate_scale, torch.randn(*shape, generator=gen)
    return g.to(device, dtype), u.to(device, dtype)
