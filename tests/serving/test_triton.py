"""`trtopt triton-repo` + the real tritonserver from the nvidia-pytriton wheel, on 127.0.0.1.

Queries go over HTTP generate, HTTP generate_stream (SSE) and gRPC streaming (tritonclient); greedy answers must
agree across all three. Concurrent requests must share engine steps: the model reports, per response, the most
requests that advanced together in one step while that request ran.
The module skips only when tritonserver itself cannot start, and says why.
"""

from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from live_server import running_tritonserver
from typer.testing import CliRunner

from trtopt.cli.main import app

MODEL = "tiny_llm"
GREEDY = {"temperature": 0.0, "ignore_eos": True, "exclude_input_in_output": True}  # the completion only


@pytest.fixture(scope="module")
def repo(tiny_plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    result = CliRunner().invoke(app, ["triton-repo", str(tiny_plan), "-o", str(out), "--name", MODEL,
                                      "--num-blocks", "128", "--max-batch-tokens", "512"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def triton(repo, tmp_path_factory):
    """(http base url, grpc address) of a running tritonserver serving `repo`."""
    with running_tritonserver(repo, tmp_path_factory.mktemp("tritonserver"), MODEL) as addresses:
        yield addresses


def _generate(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v2/models/{MODEL}/generate", json=body, timeout=120)


def _generate_stream(base: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{base}/v2/models/{MODEL}/generate_stream", json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def _grpc_stream(address: str, prompt: str, max_tokens: int) -> list[str]:
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, value.shape, dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
              tensor("temperature", np.array([0.0], dtype=np.float32), "FP32"),
              tensor("ignore_eos", np.array([True]), "BOOL"), tensor("stream", np.array([True]), "BOOL")]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs, request_id="grpc-1", enable_empty_final_response=True)
        pieces = []
        for _ in range(max_tokens + 2):  # bounded: one response per token, the last one flagged final
            result, error = results.get(timeout=60)
            assert error is None, error
            out = result.as_numpy("text_output")
            if out is not None:
                pieces.append(out[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return pieces
        raise AssertionError(f"no final response after {max_tokens + 2} responses")
    finally:
        client.stop_stream()
        client.close()


def test_repository_layout(repo, tiny_plan):
    model_dir = repo / MODEL
    config = (model_dir / "config.pbtxt").read_text()
    assert "decoupled: true" in config and 'backend: "python"' in config
    assert str(tiny_plan.resolve()) in config and "KIND_CPU" in config
    assert (model_dir / "1" / "model.py").read_text().startswith('"""Triton Inference Server Python-backend model')


def test_repository_carries_the_speculative_config(tiny_plan, tmp_path):
    """--speculative-config lands in config.pbtxt as the engine's JSON (protobuf-escaped, a draft plan's path made
    absolute); a bad config or a missing draft is refused before anything is written."""
    import re

    from google.protobuf import text_encoding

    from trtopt.builder.draft import build_draft_plan, self_draft_dir
    from trtopt.runtime.spec_decode import SpeculativeConfig

    if not (self_draft_dir(tiny_plan, 1) / "plan.json").is_file():
        build_draft_plan(tiny_plan, 1)
    runner = CliRunner()
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
                 {"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": str(self_draft_dir(tiny_plan, 1)), "num_speculative_tokens": 2}):
        out = tmp_path / spec["method"]
        result = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(out), "--speculative-config", json.dumps(spec)])
        assert result.exit_code == 0, result.output
        config = (out / "trtopt" / "config.pbtxt").read_text()
        value = re.search(r'key: "speculative_config" value: \{ string_value: "((?:[^"\\]|\\.)*)" \}', config).group(1)
        written = json.loads(text_encoding.CUnescape(value))  # what Triton hands the model's initialize()
        assert SpeculativeConfig.parse(written) == SpeculativeConfig.parse(spec)
    bad = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path / "bad"), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert bad.exit_code == 1 and "num_speculative_tokens=0" in bad.output and not (tmp_path / "bad").exists()
    missing = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path / "missing"), "--speculative-config",
                                  '{"method": "self_draft", "num_layers": 7, "num_speculative_tokens": 2}'])
    assert missing.exit_code == 1 and "--draft-layers 7" in missing.output and not (tmp_path / "missing").exists()


def test_generate_stream_and_grpc_agree(triton):
    base, grpc_address = triton
    body = {"text_input": "The capital of France is", "max_tokens": 8, **GREEDY}
    resp = _generate(base, body)
    assert resp.status_code == 200, resp.text
    full = resp.json()["text_output"]
    assert full
    events = _generate_stream(base, body)
    assert 1 < len(events) <= 8
    assert "".join(e["text_output"] for e in events) == full
    assert "".join(_grpc_stream(grpc_address, "The capital of France is", 8)) == full


def test_stop_words(triton):
    base, _ = triton
    body = {"text_input": "My favourite colours are", "max_tokens": 16, **GREEDY}
    full = _generate(base, body).json()["text_output"]
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    cut = _generate(base, {**body, "stop_words": [stop]}).json()["text_output"]
    assert cut == full[: full.index(stop)]


def test_bad_request_gets_an_error_and_the_model_lives(triton):
    base, _ = triton
    resp = _generate(base, {"text_input": "hi", "max_tokens": 0})
    assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]
    resp = _generate(base, {"text_input": "hi", "max_tokens": 2, "temperature": -1.0})
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]
    resp = _generate(base, {"text_input": " hello" * 600, "max_tokens": 2})
    assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]
    assert _generate(base, {"text_input": "hi", "max_tokens": 2, **GREEDY}).status_code == 200


def test_concurrent_requests_share_engine_steps(triton):
    base, _ = triton
    num = 6

    def one(i: int) -> dict:
        resp = _generate(base, {"text_input": f"Request number {i}:", "max_tokens": 24, **GREEDY})
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(num) as pool:
        results = list(pool.map(one, range(num)))
    sizes = [r["step_batch_size"] for r in results]
    # Served one at a time, every request would report 1.
    assert max(sizes) >= num // 2 and min(sizes) >= 2, sizes
    # Batching must not change answers: each equals the same request made alone.
    alone = _generate(base, {"text_input": "Request number 0:", "max_tokens": 24, **GREEDY}).json()
    assert alone["text_output"] == results[0]["text_output"]


def test_8mb_prompt_does_not_stall_a_concurrent_request(triton):
    """An 8 MB prompt is refused by the byte cap in execute() (it used to be tokenized on the step thread, stalling
    every other request for ~10 s). While it is in flight, 1-token requests keep being answered promptly."""
    import time

    base, _ = triton
    small = {"text_input": "hi", "max_tokens": 1, **GREEDY}
    assert _generate(base, small).status_code == 200  # warm
    huge_text = "ab " * (8 * 2**20 // 3)  # 8 MiB of UTF-8
    result: dict = {}

    def send_huge() -> None:
        start = time.monotonic()
        result["resp"] = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=120,
                                    json={"text_input": huge_text, "max_tokens": 1})
        result["elapsed"] = time.monotonic() - start

    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(send_huge)
        latencies = []
        deadline = time.monotonic() + 3.0
        while not huge.done() or time.monotonic() < deadline:  # small requests during and after the huge one
            start = time.monotonic()
            assert _generate(base, small).status_code == 200
            latencies.append(time.monotonic() - start)
        huge.result()
    resp = result["resp"]
    print(f"8 MB prompt answered in {result['elapsed']:.2f} s; {len(latencies)} concurrent 1-token requests, "
          f"slowest {max(latencies):.3f} s, median {sorted(latencies)[len(latencies) // 2]:.3f} s")
    assert resp.status_code == 400 and "bytes" in resp.json()["error"], resp.text[:300]
    # A liveness bound, not a speed claim: the stall was ~10 s; a 1-token request takes well under 0.1 s here.
    assert max(latencies) < 2.0, latencies
