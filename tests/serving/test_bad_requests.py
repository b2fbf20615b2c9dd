"""Every bad request gets its 4xx with an OpenAI-style error body, and nothing breaks: afterwards the server is
healthy, a good request works, and every KV block is free."""

from __future__ import annotations

import httpx
import pytest
from live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.base_url}{path}", content=body, timeout=30,
                          headers={**headers, "Content-Type": "application/json"}, **kwargs)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30, **kwargs)


def _assert_error(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], err["message"]


CASES = {
    # name: (path, body, status, words the message must contain)
    "malformed json": ("/v1/completions", '{"model": "tiny", "prompt": "hi",', 400, ["not valid JSON"]),
    "not an object": ("/v1/completions", "[1, 2]", 400, []),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, ["prompt"]),
    "unknown model": ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, ["gpt-17", MODEL]),
    "max_tokens 0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    "max_tokens negative (chat)": ("/v1/chat/completions",
                                   {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
                                   400, ["max_tokens"]),
    "max_tokens over the context": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400,
                                    ["maximum context length is 512"]),
    "negative temperature": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400,
                             ["temperature"]),
    "top_p out of range": ("/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400,
                           ["top_p"]),
    "n zero": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, ["n="]),
    "prompt too long": ("/v1/completions", {"model": MODEL, "prompt": " hello" * 600, "max_tokens": 1}, 400,
                        ["512"]),
    "token prompt outside vocab": ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, ["vocabulary"]),
    "empty prompt": ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, ["empty"]),
    "empty prompt in a batch": ("/v1/completions", {"model": MODEL, "prompt": ["hi", ""]}, 400, ["empty"]),
    "too long prompt in a batch": ("/v1/completions", {"model": MODEL, "prompt": ["hi", " hello" * 600]}, 400,
                                   ["512"]),
    "bad token prompt in a batch": ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], [10**9]], "max_tokens": 50},
                                    400, ["vocabulary"]),  # the good one was queued first: it must be aborted
    "mixed prompt": ("/v1/completions", {"model": MODEL, "prompt": [1, "hi"]}, 400, ["prompt"]),
    "empty messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, ["messages"]),
    "wrong field type": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400,
                         ["max_tokens"]),
    "tools": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, ["tool"]),
    "tool_choice auto": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"type": "function", "function": {"name": "f"}}],
                                                  "tool_choice": "auto"}, 400, ["'auto'", "required"]),
    "json_schema without a schema": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                              "response_format": {"type": "json_schema"}}, 400, ["json_schema"]),
    "schema that does not compile": ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
        400, ["could not be compiled"]),
    "logit_bias": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1.0}}, 400,
                   ["logit_bias"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_gets_its_4xx(server, name):
    path, body, status, words = CASES[name]
    _assert_error(_post(server, path, body), status, *words)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "not bearer"])
def test_api_key_is_required(server, headers):
    resp = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, headers=headers)
    _assert_error(resp, 401, "API key")
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).status_code == 401
    # vLLM guards /v2 like /v1: the key is checked before routing, so even a route trtopt does not serve is a 401
    assert _post(server, "/v2/embed", {"model": MODEL, "texts": ["hi"]}, headers=headers).status_code == 401


def test_the_right_key_reaches_the_routes(server):
    assert httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert _post(server, "/v2/embed", {"model": MODEL, "texts": ["hi"]}).status_code == 404  # past the key; trtopt serves generation plans, not embeddings


def test_body_over_the_limit_gets_413(server):
    resp = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000})
    _assert_error(resp, 413, "65536")


def test_unknown_route_and_method(server):
    _assert_error(httpx.get(f"{server.base_url}/v1/nothing", headers=AUTH, timeout=10), 404)
    _assert_error(httpx.get(f"{server.base_url}/v1/completions", headers=AUTH, timeout=10), 405)


def test_server_is_healthy_after_bad_requests(server):
    for path, body, _, _ in CASES.values():
        _post(server, path, body)
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    m = server.wait_idle()
    assert m["trtopt_kv_blocks_used"] == 0
    assert m["trtopt_kv_blocks_free"] == m["trtopt_kv_blocks_total"]
