"""Behaviour a user switching from vLLM's OpenAI server relies on, found by running vLLM's own server tests against
`trtopt serve` (tiny-llama, random weights, SmolLM2 tokenizer). Each test failed on the code before its fix."""

from __future__ import annotations

import httpx
import pytest

from live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def test_prompt_tokens_counter_counts_whole_prompts_as_vllm(server, tokenizer):
    """trtopt_prompt_tokens_total adds each prefilled request's whole prompt, prefix-cache hits included (it used
    to add the computed tokens only: a 9-token prompt added 8, a repeated 40-token prompt 7)."""
    prompt = " ".join(f"word{i}" for i in range(30))  # long enough to fill prefix-cache blocks
    n = len(tokenizer(prompt).input_ids)
    server.wait_idle()
    before = server.metrics()
    for _ in range(2):  # the second request hits the prefix cache
        resp = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **GREEDY})
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == n
    resp = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 1.0,
                                             "seed": 1, "ignore_eos": True})
    assert resp.status_code == 200
    after = server.wait_idle()
    assert after["trtopt_prompt_tokens_total"] - before["trtopt_prompt_tokens_total"] == 3 * n  # n=2: once
    assert after["trtopt_prefix_cache_hits_total"] > before["trtopt_prefix_cache_hits_total"]
    computed = after["trtopt_computed_prompt_tokens_total"] - before["trtopt_computed_prompt_tokens_total"]
    assert 0 < computed < 3 * n  # the cache hits were not computed


def test_completions_send_prompt_logprobs_null_when_not_asked(server):
    body = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, **GREEDY}).json()
    assert "prompt_logprobs" in body["choices"][0] and body["choices"][0]["prompt_logprobs"] is None
    asked = _post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 1,
                                              **GREEDY}).json()
    rows = asked["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and all(isinstance(r, dict) for r in rows[1:])


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_need_stream(server, stream):
    body = {"prompt": "Hello", "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "The 'stream_options' parameter is only allowed when 'stream' is enabled."


def test_required_tool_choice_with_pydantic_defs(client):
    """A pydantic-generated tool schema ($defs + $ref) works with tool_choice "required" as with a named choice."""
    import json

    import jsonschema

    person = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                    "required": ["city"], "additionalProperties": False}},
              "type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": person}}]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add Ada from Oslo."}],
                                         tools=tools, tool_choice="required", max_tokens=80, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "add_person"
    jsonschema.validate(json.loads(calls[0].function.arguments), person)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_tool_call_cut_short_is_never_content(client, tool_choice):
    """max_tokens cuts the forced call: never partial JSON in message.content, and no tool calls in the whole
    response (OpenAI's answer; vLLM's test_max_tokens_with_tool_choice_required). A named call's stream has sent its
    partial arguments; "required" streams each call whole, so nothing of it."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice=tool_choice, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "length"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_content = "".join(d.content or "" for d in deltas)
    streamed_args = "".join(tc.function.arguments or "" for d in deltas for tc in (d.tool_calls or []))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not full.message.content and not streamed_content
    assert full.message.tool_calls == []
    assert (streamed_args != "") == (tool_choice != "required")
