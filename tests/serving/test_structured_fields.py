"""The server's structured-output fields and tool choices -> StructuredOutputsParams (no model needed)."""

from __future__ import annotations

import json

import pytest

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import StructuredOutputsParams
from trtopt.serving.structured import structured_outputs_of, tool_call_plan, tool_calls

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def test_response_format_and_vllm_fields():
    assert structured_outputs_of(None, None, {}) is None
    assert structured_outputs_of({"type": "text"}, None, {}) is None
    assert structured_outputs_of({"type": "json_object"}, None, {}) == StructuredOutputsParams(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    assert structured_outputs_of(rf, None, {}) == StructuredOutputsParams(json=SCHEMA)
    assert structured_outputs_of(None, {"regex": "a+"}, {}) == StructuredOutputsParams(regex="a+")
    assert structured_outputs_of(None, None, {"guided_choice": ["x", "y"], "guided_regex": None}) == StructuredOutputsParams(choice=("x", "y"))
    assert structured_outputs_of(None, None, {"guided_grammar": "root ::= \"a\""}).grammar == "root ::= \"a\""


@pytest.mark.parametrize("args, match", [
    (({"type": "json_schema", "json_schema": {"name": "x"}}, None, {}), "json_schema needs"),
    (({"type": "xml"}, None, {}), "not one of"),
    (({"type": "json_object"}, {"regex": "a"}, {}), "set one structured-output field"),
    ((None, {"regex": "a"}, {"guided_choice": ["b"]}), "set one structured-output field"),
    ((None, {"pattern": "a"}, {}), "unknown fields"),
    ((None, {}, {"guided_json": "{bad"}), "not valid JSON"),
])
def test_malformed_fields_are_request_errors(args, match):
    with pytest.raises(RequestError, match=match):
        structured_outputs_of(*args)


def test_tool_choices():
    assert tool_call_plan(None, None) is None and tool_call_plan([WEATHER], "none") is None
    with pytest.raises(RequestError, match="'auto'.*--enable-auto-tool-choice --tool-call-parser"):
        tool_call_plan([WEATHER], "auto")
    with pytest.raises(RequestError, match="'auto'"):
        tool_call_plan([WEATHER], None)  # OpenAI's default with tools is auto
    with pytest.raises(RequestError, match="not among the tools"):
        tool_call_plan([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestError, match="each tool must be"):
        tool_call_plan([{"type": "function"}], "required")
    with pytest.raises(RequestError, match="needs a non-empty tools"):
        tool_call_plan([], "required")

    named = tool_call_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.named == "get_weather" and named.constraint.json == SCHEMA and named.finish_reason == "stop"
    calls = tool_calls(named, '{"city": "Paris"}')
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")

    required = tool_call_plan([WEATHER, TIME], "required")
    assert required.named is None and required.finish_reason == "tool_calls"
    schema = required.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls(required, text)] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]
    assert tool_calls(required, '[{"name": "get_ti') == []  # cut short by max_tokens: no calls


# pydantic's schema of `class Address(BaseModel): street: str; city: str` inside `class Person: name: str;
# address: Address; friends: list[Person]`: references through $defs and to the root ("#").
PERSON = {"$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                 "city": {"type": "string"}},
                                "required": ["street", "city"]}},
          "type": "object",
          "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"},
                         "friends": {"type": "array", "items": {"$ref": "#"}}},
          "required": ["name", "address"]}
LEGACY = {"definitions": {"Unit": {"enum": ["C", "F"]}}, "type": "object",
          "properties": {"unit": {"$ref": "#/definitions/Unit"}}, "required": ["unit"]}


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_tool_choice_keeps_refs_resolvable():
    """Regression: the "required" array schema nests each function's parameters, so "#/$defs/..." stopped
    resolving (xgrammar: "Cannot find field $defs"). The hoisted schema compiles and accepts exactly the calls the
    functions' own schemas accept."""
    import jsonschema
    import xgrammar as xgr

    schema = tool_call_plan([_tool("add_person", PERSON), _tool("set_unit", LEGACY)], "required").constraint.json
    xgr.Grammar.from_json_schema(json.dumps(schema))  # raised before the fix
    jsonschema.Draft202012Validator.check_schema(schema)
    person = {"name": "Ada", "address": {"street": "1 Main", "city": "Oslo"},
              "friends": [{"name": "Bob", "address": {"street": "2 Side", "city": "Rome"}}]}
    good = [[{"name": "add_person", "parameters": person}], [{"name": "set_unit", "parameters": {"unit": "F"}}]]
    bad = [[{"name": "add_person", "parameters": {**person, "address": {"street": "1 Main"}}}],
           [{"name": "add_person", "parameters": {**person, "friends": [{"name": "Bob"}]}}],
           [{"name": "set_unit", "parameters": {"unit": "K"}}]]
    for calls in good:
        jsonschema.validate(calls, schema)
        for call in calls:  # the same instance is valid under the function's own schema
            jsonschema.validate(call["parameters"], PERSON if call["name"] == "add_person" else LEGACY)
    for calls in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    # Plain schemas are left as they were (no $defs added).
    assert "$defs" not in tool_call_plan([WEATHER], "required").constraint.json


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_overrides_response_format(tool_choice):
    """vLLM's rule: tool_choice "required" or named replaces response_format / structured_outputs (not a 400)."""
    from trtopt.serving.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, TIME],
            "tool_choice": tool_choice}
    want = ChatCompletionRequest(**body).to_sampling_params().structured_outputs
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}}):
        assert ChatCompletionRequest(**body, **extra).to_sampling_params().structured_outputs == want
    with pytest.raises(RequestError, match="json_schema"):  # still validated
        ChatCompletionRequest(**body, response_format={"type": "json_schema"}).to_sampling_params()
