"""Structured output and tool calls over HTTP with the official `openai` client, on a live `trtopt serve` of the
real SmolLM2 (one server for the module; every request is greedy and a few dozen tokens)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import API_KEY, MODEL, start_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow  # a SmolLM2 plan and server start-up (~1 min on 2 cores)

GREEDY = {"temperature": 0.0}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                                       "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}}, "required": ["colors"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["ok", "count"]},
]


@pytest.fixture(scope="module")
def smol_server(built_plan, tmp_path_factory):
    srv = start_server(built_plan("smollm2-135m"), tmp_path_factory.mktemp("smol-log") / "serve.log", "--api-key", API_KEY,
                       "--max-model-len", "1024")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_response_format_validates(client):
    def one(schema):
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        r = client.chat.completions.create(model=MODEL, messages=_ask(f"Answer in JSON for the schema {json.dumps(schema)}"),
                                           max_tokens=60, response_format=rf, **GREEDY)
        return r.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # concurrent: they share engine steps
        choices = list(pool.map(one, SCHEMAS))
    for schema, c in zip(SCHEMAS, choices):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)


def test_json_object_regex_choice_and_grammar_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=_ask("Give me a JSON object with the keys name and age of a person."),
                                       max_tokens=40, response_format={"type": "json_object"}, **GREEDY)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="The date today is", max_tokens=16, **GREEDY,
                                  extra_body={"structured_outputs": {"regex": r"20\d\d-[01]\d-[0-3]\d"}})
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=_ask("Is water wet?"), max_tokens=5, **GREEDY,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="2 + 3 =", max_tokens=8, **GREEDY,
                                  extra_body={"guided_grammar": 'root ::= " " [0-9] [0-9]?'})
    assert re.fullmatch(r" [0-9][0-9]?", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("extra, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "could not be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema needs"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "could not be compiled"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "set one structured-output field"),
    ({"tools": [WEATHER]}, "'auto'"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "'auto'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
])
def test_bad_structured_requests_are_400(client, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=MODEL, messages=_ask("Hi"), max_tokens=4, **extra)


def test_named_tool_call_full_and_streamed(client):
    kwargs = dict(model=MODEL, messages=_ask("What is the weather in Paris?"), max_tokens=40, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content == "" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices if c.delta.tool_calls for tc in c.delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args  # the same greedy call
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_calls(client):
    kwargs = dict(model=MODEL, messages=_ask("What time is it in Tokyo?"), max_tokens=80, tools=[WEATHER, TIME],
                  tool_choice="required", **GREEDY)
    r = client.chat.completions.create(**kwargs)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [tc for ch in chunks for ch_c in ch.choices if ch_c.delta.tool_calls for tc in ch_c.delta.tool_calls]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
