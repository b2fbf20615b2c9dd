"""`trtopt bench serve`: vLLM's metric definitions on hand-made timings, the datasets, and a real run against the
session's live `trtopt serve` (tiny plan) through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from live_server import API_KEY, MODEL
from typer.testing import CliRunner

from trtopt.cli.main import app
from trtopt.serving import benchmark as bm


def test_metrics_follow_vllm_definitions():
    a = bm.RequestResult(success=True, start=0.0, prompt_len=10, output_len=5, ttft=0.2, latency=1.0, itl=[0.2, 0.2, 0.2, 0.2])
    b = bm.RequestResult(success=True, start=0.5, prompt_len=20, output_len=3, ttft=0.4, latency=0.8, itl=[0.1, 0.3])
    c = bm.RequestResult(success=False, error="HTTP 500: boom")
    m = bm.compute_metrics([a, b, c], duration_s=2.0, request_rate=4.0)
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (2, 1, 30, 8)
    assert m.request_throughput == 1.0 and m.output_throughput == 4.0 and m.total_token_throughput == 19.0
    assert m.ttft_ms["mean"] == pytest.approx(300.0) and m.e2el_ms["median"] == pytest.approx(900.0)
    # TPOT per request: (latency - ttft) / (output_len - 1) = 0.2 s and 0.2 s.
    assert m.tpot_ms["mean"] == pytest.approx(200.0)
    assert m.itl_ms["p50"] == pytest.approx(200.0) and m.itl_ms["p99"] == pytest.approx(np.percentile([200, 200, 200, 200, 100, 300], 99))
    assert m.max_concurrent_requests == 2 and m.errors == ("HTTP 500: boom",)


def test_arrival_gaps_are_poisson_or_a_burst():
    g = bm.arrival_gaps(20_000, rate=4.0, seed=1)
    assert abs(g.mean() - 0.25) < 0.01 and abs(g.std() / g.mean() - 1) < 0.03  # exponential: CV = 1
    bursty = bm.arrival_gaps(20_000, rate=4.0, burstiness=0.25, seed=1)  # same mean rate, clumped arrivals
    assert abs(bursty.mean() - 0.25) < 0.02 and bursty.std() / bursty.mean() > 1.8  # gamma: CV = 1/sqrt(shape) = 2
    assert not bm.arrival_gaps(5, rate=math.inf).any()
    assert (bm.arrival_gaps(50, 2.0, seed=7) == bm.arrival_gaps(50, 2.0, seed=7)).all()  # seeded


def test_datasets(tokenizer):
    reqs = bm.random_dataset(tokenizer, 12, input_len=40, output_len=7, range_ratio=0.25, seed=3)
    assert len(reqs) == 12 and all(5 <= r.output_len <= 8 for r in reqs)
    assert all(abs(r.prompt_len - 40) <= 0.25 * 40 + 3 for r in reqs)
    assert reqs == bm.random_dataset(tokenizer, 12, input_len=40, output_len=7, range_ratio=0.25, seed=3)  # seeded
    conv = bm.conversation_dataset(tokenizer, 250)  # more than the 200 synthetic conversations: cycles
    assert len(conv) == 250 and len({r.prompt for r in conv}) > 100 and all(r.output_len >= 1 for r in conv)


def test_bench_serve_against_the_live_server(server, tiny_plan, tmp_path):
    before = server.wait_idle()
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--tokenizer", str(tiny_plan),
            "--api-key", API_KEY, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5",
            "--request-rate", "20,inf", "--out", str(out), "--plot", str(plot)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "TTFT (ms)" in result.output and "output tok/s" in result.output
    record = json.loads(out.read_text())
    assert [r["request_rate"] for r in record["runs"]] == [20.0, math.inf]
    for run in record["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 6 * 5  # ignore_eos and the server's usage count
        assert 0 < run["ttft_ms"]["mean"] <= run["e2el_ms"]["mean"] and run["tpot_ms"]["mean"] > 0
    assert plot.stat().st_size > 10_000
    # The server's per-request Prometheus histograms saw the 12 requests (and the CLI's one test request).
    after = server.wait_idle()
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "time_per_output_token_seconds",
                 "prompt_tokens", "generation_tokens"):
        key = f"trtopt_request_{name}_count"
        assert after[key] - before.get(key, 0) == 13, name
    assert after["trtopt_request_generation_tokens_sum"] - before.get("trtopt_request_generation_tokens_sum", 0) == 13 * 5
    assert after["trtopt_kv_cache_usage_perc"] == 0.0  # idle again: every block released
    assert after["trtopt_prefix_cache_queries_total"] >= after["trtopt_prefix_cache_hits_total"]


def test_bench_serve_reports_an_unreachable_server_in_one_line(tiny_plan):
    result = CliRunner().invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                                      "--tokenizer", str(tiny_plan), "--num-prompts", "2"])
    assert result.exit_code == 1 and "ConfigError" in result.output and "test request" in result.output
