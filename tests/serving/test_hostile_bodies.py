"""A corpus of hostile request bodies: every one gets an OpenAI-style 4xx, never a 5xx, and the server stays whole
(healthy, a good request still works, every KV block free). Run against the tiny-llama server and, in a slow
variant, against a server on the real SmolLM2-135M plan.

Raw strings are sent byte for byte, so they can carry what a JSON encoder would not write: NaN, Infinity, 1e999,
lone surrogates (\\ud800), broken JSON, deep nesting.
"""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import API_KEY, MODEL, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"


def _c(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _chat(*messages, **fields) -> dict:
    return {"model": MODEL, "messages": list(messages) or [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _raw(body: dict, **raw_fields: str) -> str:
    """body as JSON, with raw_fields spliced in verbatim (values JSON itself cannot encode)."""
    text = json.dumps(body)[:-1]
    return text + "".join(f', "{k}": {v}' for k, v in raw_fields.items()) + "}"


USER = {"role": "user", "content": "hi"}

CORPUS: dict[str, tuple[str, object]] = {
    # ---- wrong JSON types (strict: no coercion)
    "stream yes": (C, _c(stream="yes")),
    "max_tokens string": (C, _c(max_tokens="8")),
    "max_tokens float": (C, _c(max_tokens=1.5)),
    "max_tokens bool": (C, _c(max_tokens=True)),
    "n string": (C, _c(n="2")),
    "temperature string": (C, _c(temperature="0.5")),
    "ignore_eos string": (C, _c(ignore_eos="no")),
    "frequency_penalty string": (C, _c(frequency_penalty="1")),
    "stream_options wrong": (C, _c(stream=True, stream_options={"include_usage": "yes"})),
    "stream_options without stream": (C, _c(stream_options={"include_usage": True})),
    "chat stream_options without stream": (CHAT, _chat(stream=False, stream_options={"include_usage": False})),
    "model int": (C, _c(model=5)),
    "model empty": (C, _c(model="")),  # a left-out model is the served one (vLLM's rule); "" names none
    "chat logprobs string": (CHAT, _chat(logprobs="yes")),
    "chat logprobs int": (CHAT, _chat(logprobs=1)),
    # ---- non-finite numbers via raw JSON
    "temperature Infinity": (C, _raw(_c(), temperature="Infinity")),
    "temperature NaN": (C, _raw(_c(), temperature="NaN")),
    "top_p -Infinity": (C, _raw(_c(), top_p="-Infinity")),
    "temperature 1e999": (C, _raw(_c(), temperature="1e999")),
    "chat temperature NaN": (CHAT, _raw(_chat(), temperature="NaN")),
    # ---- out-of-range numbers
    "temperature 101": (C, _c(temperature=101)),
    "temperature negative": (C, _c(temperature=-0.5)),
    "seed 2**64": (C, _c(seed=2**64)),
    "seed 2**63": (C, _c(seed=2**63)),
    "seed below int64": (C, _c(seed=-(2**63) - 1)),
    "top_k 2**63": (C, _c(top_k=2**63)),
    "top_k over vocab": (C, _c(top_k=10**6)),
    "top_k -2": (C, _c(top_k=-2)),
    "n 10**7": (C, _c(n=10**7)),
    "n 2**63": (C, _c(n=2**63)),
    "n zero": (C, _c(n=0)),
    "logprobs 21": (C, _c(logprobs=21)),
    "logprobs 2**31": (C, _c(logprobs=2**31)),
    "logprobs negative": (C, _c(logprobs=-1)),
    "max_tokens 2**31-1": (C, _c(max_tokens=2**31 - 1)),
    "max_tokens 2**64": (C, _c(max_tokens=2**64)),
    "max_tokens 0": (C, _c(max_tokens=0)),
    "max_tokens negative": (C, _c(max_tokens=-1)),
    "presence_penalty 3": (C, _c(presence_penalty=3)),
    "repetition_penalty 0": (C, _c(repetition_penalty=0)),
    "min_p 2": (C, _c(min_p=2)),
    "min_tokens over max_tokens": (C, _c(min_tokens=1000)),
    "min_tokens negative": (C, _c(min_tokens=-1)),
    "top_p 1e999": (C, _raw(_c(), top_p="1e999")),
    "chat max_completion_tokens 2**31-1": (CHAT, _chat(max_completion_tokens=2**31 - 1)),
    "chat n 10**7": (CHAT, _chat(n=10**7)),
    "chat top_logprobs 21": (CHAT, _chat(logprobs=True, top_logprobs=21)),
    "chat top_logprobs without logprobs": (CHAT, _chat(top_logprobs=2)),
    "chat top_logprobs -1 (the whole vocabulary)": (CHAT, _chat(logprobs=True, top_logprobs=-1)),
    "chat top_logprobs -2": (CHAT, _chat(logprobs=True, top_logprobs=-2)),
    # ---- stop strings and stop ids
    "17 stop strings": (C, _c(stop=[f"s{i}" for i in range(17)])),
    "stop string 10k chars": (C, _c(stop=["x" * 10_000])),
    "empty stop string": (C, _c(stop=[""])),
    "stop surrogate": (C, _raw(_c(), stop='["\\ud800"]')),
    "stop int": (C, _c(stop=5)),
    "stop ints": (C, _c(stop=[1, 2])),
    "stop_token_ids negative": (C, _c(stop_token_ids=[-1])),
    "stop_token_ids outside vocab": (C, _c(stop_token_ids=[10**9])),
    "100 stop_token_ids": (C, _c(stop_token_ids=list(range(100)))),
    # ---- prompts
    "prompt lone surrogate": (C, _raw({"model": MODEL, "max_tokens": 2}, prompt='"\\ud800"')),
    "prompt trailing surrogate": (C, _raw({"model": MODEL, "max_tokens": 2}, prompt='"abc\\udfff"')),
    "prompt surrogate in a batch": (C, _raw({"model": MODEL, "max_tokens": 2}, prompt='["ok", "\\udc00"]')),
    "empty prompt": (C, _c(prompt="")),
    "empty token prompt": (C, _c(prompt=[])),
    "empty token prompt in a batch": (C, _c(prompt=[[]])),
    "negative token id": (C, _c(prompt=[-1])),
    "token id outside vocab": (C, _c(prompt=[5, 10**9])),
    "token id 2**64": (C, _c(prompt=[2**64])),
    "bool token ids": (C, _c(prompt=[True])),
    "float token ids": (C, _c(prompt=[1.5])),
    "prompt object": (C, _c(prompt={"a": 1})),
    "prompt null": (C, _c(prompt=None)),
    "prompt int": (C, _c(prompt=5)),
    "prompt mixed": (C, _c(prompt=[[1, 2], "x"])),
    "prompt nested 3 deep": (C, _c(prompt=[[[1]]])),
    "prompt over the context": (C, _c(prompt=" hello" * 600, max_tokens=1)),
    # ---- chat messages
    "role int": (CHAT, _chat({"role": 5, "content": "hi"})),
    "role missing": (CHAT, _chat({"content": "hi"})),
    "content missing": (CHAT, _chat({"role": "user"})),
    "content null": (CHAT, _chat({"role": "user", "content": None})),
    "content int": (CHAT, _chat({"role": "user", "content": 5})),
    "image part": (CHAT, _chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})),
    "text part without text": (CHAT, _chat({"role": "user", "content": [{"type": "text"}]})),
    "text part int": (CHAT, _chat({"role": "user", "content": [{"type": "text", "text": 5}]})),
    "content surrogate": (CHAT, _raw({"model": MODEL}, messages='[{"role": "user", "content": "\\ud800"}]')),
    "part surrogate": (CHAT, _raw({"model": MODEL},
                                  messages='[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]')),
    "name surrogate": (CHAT, _raw({"model": MODEL}, messages='[{"role": "user", "content": "hi", "name": "\\ud800"}]')),
    "messages not a list": (CHAT, _c(messages={"role": "user", "content": "hi"})),
    "messages empty": (CHAT, _chat() | {"messages": []}),
    "message int": (CHAT, {"model": MODEL, "messages": [5]}),
    "tools": (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}])),
    "tool_choice required": (CHAT, _chat(tool_choice="required")),
    "json_schema": (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {}})),
    "chat over the context": (CHAT, _chat({"role": "user", "content": " hello" * 600})),
    "continue_final_message with add_generation_prompt": (CHAT, _chat(continue_final_message=True)),
    "chat_template without trust": (CHAT, _chat(chat_template="{{ messages }}")),
    "chat_template in kwargs without trust": (CHAT, _chat(chat_template_kwargs={"chat_template": "x"})),
    "chat_template_kwargs tokenize": (CHAT, _chat(chat_template_kwargs={"tokenize": True})),
    "chat_template_kwargs return_dict": (CHAT, _chat(chat_template_kwargs={"return_dict": True})),
    "chat_template_kwargs not an object": (CHAT, _chat(chat_template_kwargs=["x"])),
    "chat_template_kwargs deeply nested": (CHAT, json.dumps(_chat())[:-1] + ', "chat_template_kwargs": {"a": '
                                           + "[" * 5000 + "]" * 5000 + ', "tokenize": 1}}'),
    "return_token_ids string": (C, _c(return_token_ids="maybe")),
    "continuous_usage_stats int": (C, _c(stream=True, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": 1})),
    # ---- SageMaker's /invocations: the same rules as the endpoints it routes to
    "invocations neither chat nor completion": ("/invocations", {"model": MODEL, "input": "hi"}),
    "invocations json array": ("/invocations", "[1]"),
    "invocations not utf-8": ("/invocations", b"\xff\xfe{"),
    "invocations deeply nested": ("/invocations", '{"prompt": ' + "[" * 100_00 + "]" * 100_00 + "}"),
    "invocations bad chat": ("/invocations", _chat({"role": 5, "content": "hi"})),
    "invocations bad completion": ("/invocations", _c(max_tokens=2**64)),
    # ---- unsupported OpenAI fields
    "suffix": (C, _c(suffix="x")),
    # ---- token controls, echo and best_of with bad values
    "logit_bias key not an id": (C, _c(logit_bias={"abc": 1.0})),
    "logit_bias negative key": (C, _c(logit_bias={"-5": 1.0})),
    "logit_bias over 100": (C, _c(logit_bias={"5": 100.5})),
    "logit_bias id outside vocab": (C, _c(logit_bias={"999999999": 1.0})),
    "logit_bias value a string": (C, _c(logit_bias={"5": "1"})),
    "allowed_token_ids empty": (C, _c(allowed_token_ids=[])),
    "allowed_token_ids outside vocab": (C, _c(allowed_token_ids=[10**9])),
    "bad_words blank": (CHAT, _chat(bad_words=["  "])),
    "truncate_prompt_tokens 0": (C, _c(truncate_prompt_tokens=0)),
    "prompt_logprobs 21": (C, _c(prompt_logprobs=21)),
    "best_of below n": (C, _c(n=2, best_of=1)),
    "best_of streamed": (C, _c(best_of=2, stream=True)),
    # ---- not a request at all
    "json array": (C, "[1, 2]"),
    "json string": (C, '"hello"'),
    "json null": (C, "null"),
    "not utf-8": (C, b"\xff\xfe\x00garbage"),
    "truncated json": (C, '{"model": "tiny", "prompt": "hi",'),
    "deeply nested": (C, '{"model": "tiny", "prompt": ' + "[" * 100_00 + "]" * 100_00 + "}"),
    "empty body": (C, b""),
    "body over the limit": (C, _c(prompt="x" * 100_000)),
    "chat json array": (CHAT, "[]"),
}

# Bodies that are fine (and must stay fine) but look odd: the server answers 200.
ACCEPTED = {
    # vLLM's policies, taken on deliberately: its pydantic models coerce "true"/"false" for booleans (other spellings
    # stay refused above), and any int64 seed is valid (a negative one maps to its low 63 bits).
    "string booleans": (CHAT, _chat(logprobs="true", ignore_eos="false", temperature=0)),
    "seed negative": (C, _c(seed=-1)),
    "a custom role (vLLM passes any role to the chat template)": (CHAT, _chat({"role": "hacker", "content": "hi"})),
    "top_logprobs 0 without logprobs (vLLM's default)": (CHAT, _chat(top_logprobs=0)),
    "unknown fields are ignored": (C, _c(frobnicate=True, temperature=0, **{"\u00e9": 1})),
    "max_tokens that exactly fills the context": (C, _c(prompt=list(range(5, 505)), max_tokens=12, ignore_eos=True,
                                                        temperature=0)),
}


def _send(base_url: str, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, (bytes, str)):
        content = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        return httpx.post(f"{base_url}{path}", content=content, headers={"Content-Type": "application/json", **headers},
                          timeout=60)
    return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)


def _assert_4xx(resp: httpx.Response, name: str) -> None:
    assert 400 <= resp.status_code < 500, f"{name}: {resp.status_code} {resp.text[:500]}"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, name
    assert err["type"] == "invalid_request_error" and err["message"], name


def run_corpus(base_url: str) -> dict[str, int]:
    """Send every hostile body; return name -> status (each asserted 4xx)."""
    statuses = {}
    for name, (path, body) in CORPUS.items():
        resp = _send(base_url, path, body)
        _assert_4xx(resp, name)
        statuses[name] = resp.status_code
    # Wrong content types, with a body that would be valid JSON.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = httpx.post(f"{base_url}{C}", content=json.dumps(_c()), timeout=60,
                          headers={**AUTH, "Content-Type": ctype})
        _assert_4xx(resp, ctype)
    return statuses


def assert_still_whole(server) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    for name, (path, body) in ACCEPTED.items():
        resp = _send(server.base_url, path, body)
        assert resp.status_code == 200, f"{name}: {resp.text[:500]}"
    ok = _send(server.base_url, C, _c(max_tokens=3, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    m = server.wait_idle()
    assert m["trtopt_kv_blocks_used"] == 0 and m["trtopt_kv_blocks_free"] == m["trtopt_kv_blocks_total"]


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 60


def test_hostile_bodies_get_4xx_never_5xx(server):
    statuses = run_corpus(server.base_url)
    assert statuses["body over the limit"] == 413
    assert statuses["seed 2**64"] == statuses["prompt lone surrogate"] == statuses["content surrogate"] == 400
    assert_still_whole(server)
    assert "unexpected error" not in server.log()  # nothing reached the final 500 handler


def test_messages_name_the_problem(server):
    def message(name: str) -> str:
        path, body = CORPUS[name]
        return _send(server.base_url, path, body).json()["error"]["message"]

    assert "seed" in message("seed 2**64")
    assert "not valid Unicode" in message("prompt lone surrogate")
    assert "not valid Unicode" in message("content surrogate")
    assert "top_k" in message("top_k 2**63")
    assert "maximum context length is 512" in message("max_tokens 2**31-1")
    assert "at most 16 strings" in message("17 stop strings")
    assert "role" in message("role int")
    assert "content" in message("content missing")
    assert "stream" in message("stream yes")
    assert "finite" in message("temperature Infinity")
    assert "only allowed when 'stream' is enabled" in message("stream_options without stream")
    assert "only allowed when 'stream' is enabled" in message("chat stream_options without stream")


def test_auth_runs_before_body_parsing(server):
    """No key and an invalid body: 401, not the 400 a validation error would give (and the body is never read)."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(f"{server.base_url}{C}", content=b"{not json", timeout=10,
                          headers={"Content-Type": "application/json", **headers})
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
        resp = httpx.post(f"{server.base_url}{C}", json=_c(prompt="x" * 100_000), headers=headers, timeout=10)
        assert resp.status_code == 401, resp.text  # before the 413 body check, too
    # /health and /metrics are open by default.
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/metrics", timeout=10).status_code == 200


@pytest.mark.slow
def test_hostile_bodies_on_smollm2(built_plan, tmp_path):
    """The same corpus against a server on the real SmolLM2-135M plan (its real tokenizer and chat template)."""
    srv = start_server(built_plan("smollm2-135m"), tmp_path / "serve.log", "--api-key", API_KEY,
                       "--max-model-len", "512", "--num-blocks", "64", "--max-body-bytes", "65536")
    try:
        run_corpus(srv.base_url)
        assert_still_whole(srv)
        assert "unexpected error" not in srv.log() and "Traceback" not in srv.log()
    finally:
        srv.stop()
