"""GeluMul, face 3 of docs/architecture.md §4: the torch reference, bit-identical (fp32) to the unfused graph's ops.

The exporters' decompositions (dynamo at any opset, legacy below 20) all compute, op by op, each product rounded:

    tanh=1:  t = g³;  t = t·0.044715;  t = t + g;  t = t·√(2/π);  t = tanh(t);  t = t + 1;  t = t·0.5;  t = t·g
    tanh=0:  t = g / √2;  t = erf(t);  t = t + 1;  t = t·0.5;  t = t·g

then y = t·up. Differences between the exporters are exact: legacy's g·(g·g) is torch's g³ (which computes (g·g)·g),
and its (g·(1 + t))·0.5 equals g·(0.5·(1 + t)) because halving is exact. Everything is written in place into one
buffer: one allocation where the unfused graph makes nine (tanh) or five (erf), which is what the CPU path gains.
A legacy export at opset ≥ 20 writes the standard Gelu instead (torch's gelu): this reference then differs from the
unfused graph by the last bits of fp32, as the tanh GELU's two formulas do.
"""

from __future__ import annotations

import torch

from trtopt.plugins.gelu_mul.schema import KAPPA, SQRT_2, SQRT_2_OVER_PI


def gelu_mul_ref(gate: torch.Tensor, up: torch.Tensor, *, tanh: int) -> torch.Tensor:
    if tanh:
        t = torch.pow(gate, 3.0).mul_(KAPPA).add_(gate).mul_(SQRT_2_OVER_PI).tanh_()
    else:
        t = torch.div(gate, SQRT_2).erf_()
    return t.add_(1.0).mul_(0.5).mul_(gate).mul_(up)
