"""What the ops' Triton kernels (face 4 of DESIGN.md §4, plugins/<op>/kernel.py) share: the float dtypes they take,
the row view they read [..., N] tensors through, and the launch option that keeps their rounding exact."""

from __future__ import annotations

import os
from typing import Any

import torch
import triton.language as tl

# The float dtypes a kernel is launched for → the Triton dtype its DTYPE constexpr names.
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [R, n] with a dense last axis: a view where it can be (a Split half of a contiguous tensor is
    one, with row stride 2n), else a contiguous copy."""
    view = t.reshape(-1, n)
    return view if view.stride(-1) == 1 else view.contiguous()


def no_fp_fusion() -> dict[str, Any]:
    """Launch options that turn off FMA contraction (`enable_fp_fusion=False`): the unfused graph rounds every
    product before the sum, so a contracted multiply-add would round differently. The CPU interpreter
    (TRITON_INTERPRET=1) does not take the option."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
