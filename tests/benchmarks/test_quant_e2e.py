"""benchmarks/quant_e2e.py's headline keys and its notes on missed targets, from a results dict (no kernel runs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quant_e2e  # noqa: E402


def _data(fp8: tuple[float, float], int4: tuple[float, float]) -> dict:
    """Two models; the last is the headline. (speedup over bf16, fraction of own roofline) per format at batch 1."""
    def rows(fp8_row, int4_row):
        return {"bf16": {"batches": {"1": {"speedup_vs_bf16": 1.0, "fraction_of_copy_bw": 0.9}}},
                "fp8": {"batches": {"1": {"speedup_vs_bf16": fp8_row[0], "fraction_of_copy_bw": fp8_row[1]}}},
                "int4": {"batches": {"1": {"speedup_vs_bf16": int4_row[0], "fraction_of_copy_bw": int4_row[1]}}}}

    data = {"models": {"small": rows((9.0, 0.99), (9.0, 0.99)), "big": rows(fp8, int4)}}
    data.update(quant_e2e.headline(data))
    return data


def test_headline_is_the_last_model():
    data = _data((1.715, 0.826), (1.982, 0.552))
    assert data["headline_model"] == "big"
    assert data["batch1_speedup_vs_bf16"] == {"fp8": 1.715, "int4": 1.982}
    assert data["batch1_fraction_of_own_roofline"] == {"bf16": 0.9, "fp8": 0.826, "int4": 0.552}


def test_missed_targets_say_by_how_much():
    notes = quant_e2e.missed_targets(_data((1.715, 0.826), (1.982, 0.552)))
    assert notes == ["big fp8 batch 1: 1.72x bf16 against the 1.75x target (2% short)",
                     "big int4 batch 1: 1.98x bf16 against the 2.8x target (29% short)",
                     "big int4 batch 1: 55% of its own roofline against the 70% target"]
    assert quant_e2e.missed_targets(_data((1.8, 0.8), (2.9, 0.75))) == []  # every target met: no note
