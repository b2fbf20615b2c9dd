"""vLLM server features that users rely on, against a live `trtopt serve` (tiny-llama, SmolLM2 tokenizer): the extra
endpoints and flags, token ids out, continuous usage, vLLM's metric names, vLLM's input policies and chat options.

Two servers: the session's default one (every switch off) and one with vLLM's switches on."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import pytest

from live_server import API_KEY, MODEL, start_server

import trtopt

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def flagged(tiny_plan, tmp_path_factory):
    """A server with vLLM's switches on, behind the root path /llm."""
    srv = start_server(tiny_plan, tmp_path_factory.mktemp("flagged-log") / "serve.log", "--api-key", API_KEY,
                       "--root-path", "/llm", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
                       "--enable-force-include-usage", "--trust-request-chat-template")
    yield srv
    srv.stop()


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=60, **kw)


def _stream(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response ([DONE] checked and dropped)."""
    with httpx.stream("POST", f"{server.base_url}{path}", json={"model": MODEL, "stream": True, **body}, headers=AUTH,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _chat_template_ids(tokenizer, messages, **kw) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=not text.startswith(tokenizer.bos_token or "\0")).input_ids


# ---- endpoints and flags -------------------------------------------------------------------------------------


def test_version_is_trtopts_and_open(server):
    resp = httpx.get(f"{server.base_url}/version", timeout=10)  # no key: open, like /health
    assert resp.status_code == 200 and resp.json() == {"version": trtopt.__version__}


def test_ping_is_health(server):
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.base_url}/ping", timeout=10).status_code == 200


def test_load_stays_zero_without_tracking(server):
    assert httpx.get(f"{server.base_url}/load", timeout=10).json() == {"server_load": 0}
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{server.base_url}/load", timeout=10).json() == {"server_load": 0}


def _load(srv) -> int:
    return httpx.get(f"{srv.base_url}/load", timeout=10).json()["server_load"]


def _wait_load(srv, value: int) -> None:
    deadline = time.monotonic() + 30
    while _load(srv) != value:
        assert time.monotonic() < deadline, f"server_load stayed {_load(srv)}, expected {value}"
        time.sleep(0.05)


def test_load_counts_in_flight_requests(flagged):
    assert _load(flagged) == 0
    # A stream in flight counts until it has been sent; a client that leaves mid-stream stops counting too.
    with httpx.stream("POST", f"{flagged.base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": True, **GREEDY}) as resp:
        lines = resp.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        assert _load(flagged) == 1
        # A non-streamed request at the same time: 2 while both run.
        done = threading.Event()
        threading.Thread(target=lambda: (_post(flagged, "/v1/completions", {"prompt": "x", "max_tokens": 300,
                                                                            **GREEDY}), done.set())).start()
        _wait_load(flagged, 2)
    _wait_load(flagged, 1)  # the stream's client left
    assert done.wait(60)
    _wait_load(flagged, 0)
    # Rejected requests count while handled, and no longer after.
    assert _post(flagged, "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}).status_code == 400
    assert _post(flagged, "/invocations", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    _wait_load(flagged, 0)  # the count drops once the response is sent


def test_invocations_route_by_body_shape(server):
    chat = _post(server, "/invocations", {"messages": USER, "max_tokens": 3, **GREEDY})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, **GREEDY})
    assert chat.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    comp = _post(server, "/invocations", {"prompt": "Hello", "max_tokens": 3, **GREEDY})
    assert comp.status_code == 200 and comp.json()["object"] == "text_completion"
    chunks = _stream(server, "/invocations", {"prompt": "Hello", "max_tokens": 3, **GREEDY})
    assert "".join(c["choices"][0]["text"] for c in chunks) == comp.json()["choices"][0]["text"]


@pytest.mark.parametrize("body, status, words", [
    ({"model": MODEL, "input": "hi"}, 400, "Cannot find suitable handler"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": 5, "content": "hi"}]}, 400, "role"),
    ({"model": MODEL, "prompt": "hi", "echo": "sometimes"}, 400, "echo"),
    ([1, 2], 400, "JSON object"),
    ("{broken", 400, "not valid JSON"),
])
def test_invocations_errors_are_4xx(server, body, status, words):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(f"{server.base_url}/invocations", content=content, timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    assert words in resp.json()["error"]["message"]


def test_invocations_needs_the_key_and_json(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/invocations", json=body, timeout=10).status_code == 401
    resp = httpx.post(f"{server.base_url}/invocations", content=json.dumps(body), timeout=10,
                      headers={**AUTH, "Content-Type": "text/plain"})
    assert resp.status_code == 415 and "application/json" in resp.json()["error"]["message"]


def test_root_path_routes_both_ways_and_stays_guarded(flagged):
    import openai

    for prefix in ("/llm", ""):
        assert httpx.get(f"{flagged.base_url}{prefix}/v1/models", headers=AUTH, timeout=10).status_code == 200
        # The key guards the prefixed paths as well as the bare ones.
        assert httpx.get(f"{flagged.base_url}{prefix}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{flagged.base_url}{prefix}/version", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=f"{flagged.base_url}/llm/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert out.choices[0].message.role == "assistant"


def test_tokenizer_info_is_gated_by_its_flag(server, flagged, tokenizer):
    assert httpx.get(f"{server.base_url}/tokenizer_info", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(f"{flagged.base_url}/tokenizer_info", timeout=10).status_code == 401  # it shows the template
    info = httpx.get(f"{flagged.base_url}/tokenizer_info", headers=AUTH, timeout=10).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert "vocab_file" not in info and "merges_file" not in info
    assert info.get("eos_token") in (None, tokenizer.eos_token)  # special tokens as their text


# ---- token ids out ---------------------------------------------------------------------------------------------


def test_completion_token_ids(server, tokenizer):
    body = {"prompt": ["Hello there", "One two"], "max_tokens": 5, "return_token_ids": True, **GREEDY}
    full = _post(server, "/v1/completions", body).json()
    for choice, prompt in zip(full["choices"], body["prompt"]):
        assert choice["prompt_token_ids"] == tokenizer(prompt).input_ids
        assert len(choice["token_ids"]) == 5
    assert full["usage"]["completion_tokens"] == 10
    chunks = _stream(server, "/v1/completions", body)
    for i, choice in enumerate(full["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert sum((c["token_ids"] for c in mine), []) == choice["token_ids"]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]  # the first chunk only
        assert all("prompt_token_ids" not in c for c in mine[1:])
    plain = _post(server, "/v1/completions", {**body, "return_token_ids": False}).json()
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None  # vLLM's


def test_chat_token_ids(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = _chat_template_ids(tokenizer, USER, add_generation_prompt=True)
    assert out.model_extra["prompt_token_ids"] == prompt_ids
    assert len(out.choices[0].model_extra["token_ids"]) == 4
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids  # with the role, as vLLM sends it
    assert all(c.model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks[1:]), [])
    assert streamed == out.choices[0].model_extra["token_ids"]


def test_return_tokens_as_token_ids(server):
    body = {"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True, **GREEDY}
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(re.fullmatch(r"token_id:\d+", alt["token"]) for e in content for alt in e["top_logprobs"])
    comp = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 1, "echo": True,
                                             "return_token_ids": True, "return_tokens_as_token_ids": True,
                                             **GREEDY}).json()["choices"][0]
    ids = comp["prompt_token_ids"] + comp["token_ids"]
    assert comp["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(re.fullmatch(r"token_id:\d+", k) for row in comp["logprobs"]["top_logprobs"][1:] for k in row)


# ---- usage -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello", "n": 2}),
    ("/v1/chat/completions", {"messages": USER}),
])
def test_continuous_usage_stats(server, path, body):
    body = {**body, "max_tokens": 4, **GREEDY}
    chunks = _stream(server, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *content, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4 * body.get("n", 1)
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in content)
    per_choice: dict[int, list[int]] = {}
    for c in content:
        u = c["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        per_choice.setdefault(c["choices"][0]["index"], []).append(u["completion_tokens"])
    for counts in per_choice.values():  # per choice, as vLLM counts: that choice's tokens so far
        assert counts == sorted(counts) and counts[-1] == 4
    # continuous_usage_stats without include_usage: no usage anywhere (vLLM's rule).
    plain = _stream(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)


def test_force_include_usage(flagged):
    chunks = _stream(flagged, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, **GREEDY})
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


# ---- metrics -----------------------------------------------------------------------------------------------------


def _samples(srv) -> dict[str, float]:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    return {name: float(value) for name, _, value in (l.rpartition(" ") for l in text.splitlines())
            if name and not name.startswith("#")}


def test_vllm_metric_names(server):
    assert _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, **GREEDY}).status_code == 200
    server.wait_idle()
    m = _samples(server)
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for trt, vllm in [("trtopt_num_requests_running", "vllm:num_requests_running"),
                      ("trtopt_num_requests_waiting", "vllm:num_requests_waiting"),
                      ("trtopt_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                      ("trtopt_prompt_tokens_total", "vllm:prompt_tokens_total"),
                      ("trtopt_generation_tokens_total", "vllm:generation_tokens_total"),
                      ("trtopt_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                      ("trtopt_num_preemptions_total", "vllm:num_preemptions_total"),
                      ("trtopt_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                      ("trtopt_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
                      ("trtopt_inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
                      ("trtopt_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
                      ("trtopt_request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_sum"),
                      ("trtopt_request_prompt_tokens_count", "vllm:request_prompt_tokens_count")]:
        assert m[vllm + labels] == m[trt], vllm
    assert m["vllm:generation_tokens_total" + labels] >= 3
    assert m['vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'] >= 1
    assert m['vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"}'] >= 1


# ---- input policies --------------------------------------------------------------------------------------------


def test_negative_seed_maps_deterministically(server):
    def text(seed: int) -> str:
        resp = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0,
                                                 "seed": seed, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    assert text(-1) == text(-1) == text(2**63 - 1)  # -1 is 2**63 - 1: the low 63 bits
    assert text(-(2**63)) == text(0)
    for seed, kind in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):  # vLLM's test_long_seed
        resp = _post(server, "/v1/chat/completions", {"messages": USER, "seed": seed})
        assert resp.status_code == 400 and "int64" in resp.json()["error"]["message"], resp.text
        assert kind in resp.json()["error"]["message"]


def test_string_booleans(server):
    body = {"messages": USER, "max_tokens": 2, "logprobs": "true", "top_logprobs": 1, "ignore_eos": "TRUE",
            "temperature": 0}
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert len(choice["logprobs"]["content"]) == 2
    assert _post(server, "/v1/chat/completions", {**body, "logprobs": "false",
                                                  "top_logprobs": None}).json()["choices"][0]["logprobs"] is None
    for bad in ("yes", "1", 1):  # other spellings stay refused
        resp = _post(server, "/v1/chat/completions", {**body, "logprobs": bad})
        assert resp.status_code == 400 and "logprobs" in resp.json()["error"]["message"]


def test_top_logprobs_minus_one_is_the_whole_vocabulary_and_refused(server):
    resp = _post(server, "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "Requested sample logprobs of 49152, which is greater than max allowed: 20" in message
    ok = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "top_logprobs": 0})
    assert ok.status_code == 200  # vLLM's default top_logprobs is 0: fine without logprobs


# ---- --max-logprobs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all_logprobs(tiny_plan, tmp_path_factory):
    """A server whose requests may ask for the whole vocabulary (--max-logprobs -1; vLLM's test passes the vocab)."""
    srv = start_server(tiny_plan, tmp_path_factory.mktemp("all-logprobs-log") / "serve.log", "--api-key", API_KEY,
                       "--max-logprobs", "-1")
    yield srv
    srv.stop()


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -1},
     "Requested prompt logprobs of 49152, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "Requested sample logprobs of 21"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 30}, "Requested prompt logprobs of 30"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 21}, "Requested sample logprobs of 21"),
    # vLLM's validation messages for negative values (-1 is the whole vocabulary, except in completions' logprobs)
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "`logprobs` must be a positive value."),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -2},
     "`top_logprobs` must be a positive value or -1."),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -2},
     "`prompt_logprobs` must be a positive value or -1."),
])
def test_logprobs_over_the_cap_are_400s_with_vllms_message(server, path, body, message):
    resp = _post(server, path, {"max_tokens": 2, **body})
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
    plain = {k: v for k, v in body.items() if "logprobs" not in k}
    assert _post(server, path, {**plain, "max_tokens": 2}).status_code == 200  # the server goes on


def test_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(all_logprobs, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{all_logprobs.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0, logprobs=True,
                                         top_logprobs=-1)
    (entry,) = out.choices[0].logprobs.content
    values = [t.logprob for t in entry.top_logprobs]
    assert len(values) == 49152 and values == sorted(values, reverse=True)  # every token, best first
    assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-3)
    assert entry.logprob == values[0]  # greedy: the chosen token is the best one
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                         extra_body={"prompt_logprobs": -1})
    rows = out.model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == out.usage.prompt_tokens
    assert all(len(row) == 49152 for row in rows[1:])
    # 30 is allowed too, and completions' echo gets the prompt's logprobs with it
    comp = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=1, logprobs=30, echo=True)
    assert all(len(top) >= 30 for top in comp.choices[0].logprobs.top_logprobs[1:])


def test_whole_vocabulary_logprobs_are_bounded_in_volume(all_logprobs):
    """Whole-vocabulary logprobs of every token of a long prompt or output would be gigabytes: a 400 that says so."""
    resp = _post(all_logprobs, "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1})
    assert resp.status_code == 400 and "logprob entries" in resp.json()["error"]["message"]  # no max_tokens: 2048
    resp = _post(all_logprobs, "/v1/completions", {"prompt": " hello" * 200, "max_tokens": 1, "prompt_logprobs": -1})
    assert resp.status_code == 400 and "logprob entries" in resp.json()["error"]["message"]


def test_serve_refuses_a_bad_max_logprobs_before_loading(tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["serve", str(tmp_path / "no-plan"), "--max-logprobs", "-2"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "max_logprobs=-2 must be -1" in result.output


# ---- chat options ----------------------------------------------------------------------------------------------


PREFILL = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two"}]


def test_continue_final_message_and_echo(server, tokenizer):
    body = {"messages": PREFILL, "max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True, "return_token_ids": True, **GREEDY}
    out = _post(server, "/v1/chat/completions", body).json()
    assert out["prompt_token_ids"] == _chat_template_ids(tokenizer, PREFILL, continue_final_message=True)
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("One, two")
    plain = _post(server, "/v1/chat/completions", {**body, "echo": False}).json()["choices"][0]["message"]
    assert message["content"] == "One, two" + plain["content"]
    chunks = _stream(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "One, two"}  # the echo chunk
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]


def test_add_generation_prompt_false(server, tokenizer):
    out = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "add_generation_prompt": False,
                                                 "echo": True, "return_token_ids": True, **GREEDY}).json()
    assert out["prompt_token_ids"] == _chat_template_ids(tokenizer, USER, add_generation_prompt=False)
    message = out["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Hello there")  # vLLM: the last role
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, timeout=30,
                        json={"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True})
    assert tokens.json()["tokens"] == _chat_template_ids(tokenizer, PREFILL, continue_final_message=True)
    both = _post(server, "/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True})
    assert both.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in both.json()["error"]["message"]


def test_request_chat_template_needs_trust(server, flagged, tokenizer):
    template = "{% for m in messages %}{{ greeting }}{{ m['content'] }}{% endfor %}"
    body = {"messages": USER, "max_tokens": 2, "chat_template": template, "chat_template_kwargs": {"greeting": "Hi! "},
            "return_token_ids": True, **GREEDY}
    refused = _post(server, "/v1/chat/completions", body)
    assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]
    out = _post(flagged, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    assert out.json()["prompt_token_ids"] == tokenizer("Hi! Hello there").input_ids
    # kwargs alone need no trust; they may not override apply_chat_template's own parameters.
    kw = {"messages": USER, "max_tokens": 2, "return_token_ids": True, **GREEDY}
    assert _post(server, "/v1/chat/completions", {**kw, "chat_template_kwargs": {"x": 1}}).status_code == 200
    bad = _post(flagged, "/v1/chat/completions", {**kw, "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and "tokenize" in bad.json()["error"]["message"]
