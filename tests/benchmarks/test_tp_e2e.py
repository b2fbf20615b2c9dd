"""benchmarks/tp_e2e.py's pure logic: option parsing, run keys, the shapes' parameter counts, the layer
extrapolation, speedups, the per-rank timeline summary and the report's resume/merge (no model is built)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tp_e2e  # noqa: E402


def test_parse_sizes_and_layers():
    assert tp_e2e.parse_sizes("4,1,2,2") == (1, 2, 4)
    with pytest.raises(argparse.ArgumentTypeError):
        tp_e2e.parse_sizes("0,2")
    assert tp_e2e.parse_layers(None, ["8b", "70b"]) == {"8b": 32, "70b": 80}
    assert tp_e2e.parse_layers("8", ["8b", "70b"]) == {"8b": 8, "70b": 8}
    assert tp_e2e.parse_layers("70b=10", ["8b", "70b"]) == {"8b": 32, "70b": 10}
    for bad in ("1", "8b=40", "1b=4"):
        with pytest.raises(argparse.ArgumentTypeError):
            tp_e2e.parse_layers(bad, ["8b", "70b"])


def test_keys():
    assert tp_e2e.run_key(1, "replicated", None) == "1"
    assert tp_e2e.run_key(4, "replicated", "p2p") == "4/p2p"
    assert tp_e2e.run_key(2, "vocab-parallel", "nccl") == "2-vocab/nccl"


def test_shape_params_match_the_llama_models():
    assert tp_e2e.shape_params(tp_e2e.SHAPES["8b"], tied=False) == 8_030_261_248  # Llama-3-8B
    assert tp_e2e.shape_params(tp_e2e.SHAPES["70b"], tied=False) == 70_553_706_496  # Llama-3-70B
    assert tp_e2e.shape_params(tp_e2e.SHAPES["1b"], tied=True) == 1_235_814_400  # tp_e2e_h200.json's 1b


def test_fits_one_gpu():
    gpu = 80 * tp_e2e.GIB
    assert tp_e2e.fits_one_gpu(16 * tp_e2e.GIB, 30, gpu)
    assert not tp_e2e.fits_one_gpu(50 * tp_e2e.GIB, 30, gpu)


def test_line_fit_and_extrapolation():
    assert tp_e2e.line_fit([(2, 3.0), (8, 6.0)]) == (2.0, 0.5)
    assert tp_e2e.line_fit([(8, 4.0)]) == (0.0, 0.5)  # proportional

    def row(ms: float, wall: float) -> dict:
        return {"batch1": {"ms_per_token": ms}, "workload": {"wall_s": wall, "output_tokens": 1000},
                "workload_spec": {"requests": 8}}

    out = tp_e2e.extrapolate_run({8: row(6.0, 10.0), 2: row(3.0, 4.0)}, 32)
    assert out["method"] == "two-point line" and out["from_layers"] == [2, 8]
    assert out["batch1"]["per_layer_ms"] == 0.5 and out["batch1"]["ms_per_token"] == 18.0
    assert out["batch1"]["decode_tok_s"] == pytest.approx(1e3 / 18.0)
    assert out["workload"]["wall_s"] == 34.0 and out["workload"]["output_tok_s"] == pytest.approx(1000 / 34.0)
    mixed = tp_e2e.extrapolate_run({8: row(6.0, 10.0), 2: {**row(3.0, 4.0), "workload_spec": {"requests": 4}}}, 32)
    assert "workload" not in mixed  # two workloads are not one line


def test_implausible_extrapolations_are_flagged_not_reported():
    """The 4xH200 run's N=4 rows: 2 and 4 layers within noise gave a negative per-layer cost (and a 7.9x
    "extrapolated speedup"); such fits keep their numbers but lose their tok/s and speedup."""
    def row(layers: int, ms: float, wall: float, rank_bytes: float) -> dict:
        return {"batch1": {"ms_per_token": ms}, "workload": {"wall_s": wall, "output_tokens": 1000},
                "workload_spec": {"requests": 8}, "weight_bytes_per_rank": [rank_bytes * layers + 1e9]}

    by_key = {"1": {2: row(2, 0.536, 0.55, 436e6), 4: row(4, 0.794, 0.86, 436e6)},  # 3.4 TB/s per layer
              "2/nccl": {2: row(2, 0.594, 0.69, 218e6), 4: row(4, 0.696, 0.81, 218e6)},  # 51 us/layer >= 58? no
              "4/p2p": {2: row(2, 0.622, 0.80, 109e6), 4: row(4, 0.618, 0.76, 109e6)},  # slope < 0
              "4/nccl": {2: row(2, 0.400, 0.60, 109e6), 4: row(4, 0.480, 0.70, 109e6)}}  # 40 us/layer: plausible
    runs = {key: tp_e2e.extrapolate_run(rows, 32) for key, rows in by_key.items()}
    tp_e2e.flag_implausible(runs, by_key)
    assert "unreliable" not in runs["1"]["batch1"] and "decode_tok_s" in runs["1"]["batch1"]
    assert "unreliable" in runs["4/p2p"]["batch1"] and "decode_tok_s" not in runs["4/p2p"]["batch1"]
    assert "unreliable" in runs["4/p2p"]["workload"] and "output_tok_s" not in runs["4/p2p"]["workload"]
    assert "unreliable" in runs["2/nccl"]["batch1"]  # 51 us/layer < 218 MB at 3.4 TB/s / 1.1 = 58 us
    assert "unreliable" not in runs["4/nccl"]["batch1"]  # 40 us >= 29 us
    assert runs["4/p2p"]["batch1"]["per_layer_ms"] < 0  # the fit itself is kept for the record
    assert set(tp_e2e.series_of(runs)) == {"nccl"} and set(tp_e2e.series_of(runs)["nccl"]) == {1, 4}


def test_speedups_compare_like_with_like():
    one = {"batch1": {"decode_tok_s": 100.0}, "workload": {"output_tok_s": 1000.0}, "workload_spec": {"r": 8},
           "host": "a", "gpu": "H100"}
    runs = {"1": one,
            "2/nccl": {**one, "batch1": {"decode_tok_s": 150.0}, "workload": {"output_tok_s": 1800.0}},
            "4/p2p": {**one, "batch1": {"decode_tok_s": 200.0}, "workload_spec": {"r": 4}, "host": "b"}}
    got = tp_e2e.speedups(runs)
    assert got["2/nccl"] == {"batch1": 1.5, "workload": 1.8, "same_host": True}
    assert got["4/p2p"] == {"batch1": 2.0, "same_host": False}
    assert tp_e2e.speedups({"2/nccl": one}) == {}


def test_union_length_counts_overlapping_kernels_once():
    assert tp_e2e.union_length([]) == 0.0
    assert tp_e2e.union_length([(0, 10)]) == 10
    # overlap (0-10 with 5-12), containment (20-30 holds 22-25), a gap (12-20 idle), unsorted input
    assert tp_e2e.union_length([(20, 30), (5, 12), (0, 10), (22, 25)]) == 22
    assert tp_e2e.union_length([(0, 5), (5, 7)]) == 7  # touching intervals


def test_timeline_summary_offsets_from_rank0():
    # 5 steps; rank 1 starts 30 µs after rank 0, ends together; the first step is eager (not graphed)
    rank0 = [[k * 10_000, 1_000_000 + k * 100_000, 1_080_000 + k * 100_000, k > 0] for k in range(5)]
    rank1 = [[h + 20_000, s + 30_000, e, g] for h, s, e, g in rank0]
    got = tp_e2e.timeline_summary({0: rank0, 1: rank1}, plot_steps=2, skip=1)
    assert got["steps"] == 3 and got["graphed"]  # 4 graphed steps, the first skipped
    assert got["per_rank"]["1"]["start_offset_us"]["median"] == 30.0
    assert got["per_rank"]["1"]["host_offset_us"]["median"] == 20.0
    assert got["per_rank"]["1"]["end_offset_us"]["max"] == 0.0
    assert got["per_rank"]["0"]["duration_us"]["median"] == 80.0
    assert got["per_rank"]["1"]["duration_us"]["median"] == 50.0
    assert got["per_rank"]["0"]["gap_to_next_us"]["median"] == 20.0  # end 80 µs in, the next start at 100
    assert got["per_rank"]["1"]["gap_to_next_us"]["median"] == 50.0
    assert got["first_steps_us"] == {"0": [[0.0, 80.0], [100.0, 180.0]], "1": [[30.0, 80.0], [130.0, 180.0]]}


def _row(tok_s: float, wall: float) -> dict:
    return {"batch1": {"decode_tok_s": tok_s, "ms_per_token": 1e3 / tok_s},
            "workload": {"wall_s": wall, "output_tokens": 500, "output_tok_s": 500 / wall},
            "workload_spec": {"requests": 8}, "host": "h", "gpu": "g"}


def test_report_extrapolates_and_resumes_from_an_earlier_json(tmp_path):
    results = tp_e2e.Results(tmp_path / "results.json", fresh=False)
    models = {"8b": [tp_e2e.Model("8b", dataclasses.replace(tp_e2e.SHAPES["8b"], layers=layers), False)
                     for layers in (8, 2)]}
    every = results.add_models(models)
    assert [m.tag for m in every["8b"]] == ["8b-L8", "8b-L2"]
    for tag, scale in (("8b-L8", 1.0), ("8b-L2", 2.5)):
        results.put("rows", tag, "1", _row(100.0 * scale, 10.0 / scale))
        results.put("rows", tag, "2/nccl", _row(150.0 * scale, 6.0 / scale))
    results.put("rows", "8b-L8", "4/p2p", {"error": "timed out after 300 s"})
    data = tp_e2e.report(results, every, {"8b": 32}, {"workload": {"requests": 8}})
    entry = data["shapes"]["8b"]
    assert entry["measured"]["8"]["speedup"]["2/nccl"]["batch1"] == 1.5
    assert entry["measured"]["8"]["failed"] == {"4/p2p": "timed out after 300 s"}
    extrapolated = entry["extrapolated"]
    assert "EXTRAPOLATED" in extrapolated["note"] and extrapolated["to_layers"] == 32
    # batch 1: 10 ms at 8 layers, 4 ms at 2 -> 1 ms/layer + 2 ms -> 34 ms at 32 layers
    assert extrapolated["runs"]["1"]["batch1"]["ms_per_token"] == pytest.approx(34.0)
    assert extrapolated["runs"]["1"]["batch1"]["per_layer_ms"] == pytest.approx(1.0)
    assert extrapolated["speedup"]["2/nccl"]["batch1"] == pytest.approx(34.0 / (34.0 / 1.5))
    assert not results.done("rows", "8b-L8", "4/p2p") and results.done("rows", "8b-L8", "1")

    # A later call on a fresh machine (empty --work) with the JSON as the lead's tree holds it: the rows come back.
    again = tp_e2e.Results(tmp_path / "fresh" / "results.json", fresh=False, earlier=data)
    assert again.done("rows", "8b-L2", "2/nccl") and again.data["models"]["8b"] == [8, 2]
    assert tp_e2e.Results(tmp_path / "results.json", fresh=True, earlier=data).data["rows"] == {}


def test_nnodes_summary():
    rows = {"size": 4, "1node/net": {"batch1": {"decode_tok_s": 100.0}},
            "2nodes/net": {"batch1": {"decode_tok_s": 80.0}}, "2nodes/local": {"error": "x"}}
    got = tp_e2e.nnodes_summary(rows)
    assert got["size"] == 4 and got["two_over_one_batch1"] == {"net": 0.8} and "size" not in got["rows"]


def test_curves_and_plots(tmp_path):
    runs = {"1": _row(100.0, 5.0), "2/nccl": _row(150.0, 4.0), "2/p2p": _row(170.0, 3.5)}
    series = tp_e2e.series_of(runs)
    assert series["nccl"] == {1: (100.0, 100.0), 2: (150.0, 125.0)} and series["p2p"][2] == (170.0, 500 / 3.5)
    entry = {"measured": {"2": {"runs": runs}}, "full_layers": 2}
    assert [(suffix, style) for suffix, style, _ in tp_e2e.curves(entry)] == [("", "-o")]
    extrapolated = {**entry, "full_layers": 32, "extrapolated": {"runs": {"1": {"batch1": {"decode_tok_s": 9.0}}}}}
    assert [suffix for suffix, _, _ in tp_e2e.curves(extrapolated)] == [
        ", 2 layers measured", ", EXTRAPOLATED to 32 layers"]
    data = {"gpu": "cpu", "date": "d", "workload": {"requests": 8}, "shapes": {"tiny": entry, "8b": extrapolated}}
    tp_e2e.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert not tp_e2e.plot_timeline(data, tmp_path / "t.png")  # no timed run: no file
