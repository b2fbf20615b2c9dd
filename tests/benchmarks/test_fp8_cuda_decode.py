"""The fragment bookkeeping of the CUDA decode kernel (decode_cuda.py), as benchmarks/fp8_cuda_decode.py emulates it
(`emulate`: the d and key orders, 8x8 transposes, masking and softmax merges, lane by lane in numpy under PTX's
documented m16n8k16 and movmatrix layouts), against plain attention. The CUDA itself needs a GPU
(tests/plugins/test_paged_attention_cuda_decode.py); this checks the design it implements."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_cuda_decode as probe  # noqa: E402


@pytest.mark.parametrize("seq_len, warps", [(37, 4), (16, 4), (7, 4), (100, 2)])
def test_emulated_kernel_equals_attention(seq_len, warps):
    """Within the f16 rounding of the probabilities (the kernel packs P to f16 for the second dot)."""
    assert probe.emulate(seq_len, warps=warps) < 5e-4


def test_emulation_sees_a_wrong_fragment_layout(monkeypatch):
    """The check can fail: with the 8x8 transpose left out, P^T's fragments hold the wrong keys."""
    monkeypatch.setattr(probe, "_movmatrix_trans", lambda x: list(x))
    assert probe.emulate(37) > 1e-2
