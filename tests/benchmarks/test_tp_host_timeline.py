"""benchmarks/tp_host_timeline.py's summary: phase offsets from rank 0's publish and the time between phases, per
rank, over the chosen steps (no model is run)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tp_host_timeline  # noqa: E402


def test_summary_offsets_and_gaps():
    def rank0(t):
        return {"enter": t, "encoded": t + 10_000, "pickled": t + 20_000, "published": t + 30_000,
                "shared": t + 40_000, "execute": t + 45_000, "launched": t + 90_000}

    def worker(t):  # sees each step 20 µs after rank 0's publish, launches 150 µs after it
        return {"wait": t - 500_000, "seen": t + 50_000, "received": t + 60_000, "decoded": t + 70_000,
                "shared": t + 120_000, "execute": t + 130_000, "launched": t + 180_000}

    starts = [k * 1_000_000 for k in range(6)]
    ranks = {0: [rank0(t) for t in starts], 1: [worker(t) for t in starts]}
    ranks[1][0].pop("launched")  # a step outside the chosen ones may lack phases
    out = tp_host_timeline.summarize(ranks, range(1, 6))
    assert list(out["0"]["offset_from_rank0_published_us"]) == ["enter", "encoded", "pickled", "published", "shared",
                                                                 "execute", "launched"]
    assert out["0"]["offset_from_rank0_published_us"]["enter"] == {"median": -30.0, "p90": -30.0}
    assert out["1"]["offset_from_rank0_published_us"]["seen"] == {"median": 20.0, "p90": 20.0}
    assert out["1"]["offset_from_rank0_published_us"]["launched"]["median"] == 150.0
    assert out["1"]["between_phases_us"]["decoded->shared"]["median"] == 50.0
    assert "fill" not in out["1"]["offset_from_rank0_published_us"]  # CPU: no graphs
