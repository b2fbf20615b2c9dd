"""tool_choice "auto" with vLLM's tool-call parsers (trtopt.serving.tool_parsers): each parser on scripted model
replies (text around calls, several calls, malformed ones staying content), streaming split at every character
boundary giving the non-streamed answer, the server flags, and the live HTTP server (uvicorn, the official openai
client) on a model-free executor that says a scripted reply in SmolLM2's tokens."""

from __future__ import annotations

import json

import pytest

from scripted import ScriptedExecutor, scripted_engine
from trtopt.errors import ConfigError
from trtopt.serving.tool_parsers import TOOL_PARSERS, ToolCallStream, check_tool_options, get_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}

# (parser, model reply, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me look.\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":[1, 2]}}</tool_call>'
     '\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\nBoth asked.',
     "Let me look.\nBoth asked.", [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")]),
    ("hermes", 'A tag < and <tool no call.', 'A tag < and <tool no call.', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "a \\"}\\" {"}}', None, [("f", '{"s": "a \\"}\\" {"}')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '{"name": "a", "arguments": {"x": 1.5e3, "y": null}} ; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": 1.5e3, "y": null}'), ("b", "{}")]),
    ("llama3_json", 'The answer is 4.', 'The answer is 4.', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "t", "arguments": {}}]', None, [("get_weather", '{"city": "Paris"}'), ("t", "{}")]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"tz":"UTC"}',
     "Checking.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz":"UTC"}')]),
    ("mistral", 'No [TOOL calls here.', 'No [TOOL calls here.', []),
    ("pythonic", '[get_weather(city="Paris", days=[1, 2]), get_time(tz=\'UTC\', dst=True, n=-1), ping()]', None,
     [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "UTC", "dst": true, "n": -1}'),
      ("ping", "{}")]),
    ("pythonic", '[get_weather(city="Paris, \\"France\\"")]\n', None,
     [("get_weather", '{"city": "Paris, \\"France\\""}')]),
    ("pythonic", 'It is sunny.', 'It is sunny.', []),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"arguments": {}, "name": "get_time"}]', None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("granite", ' <tool_call> [{"name": "f", "arguments": {"a": [1, {"b": null}]}}]\n', None,
     [("f", '{"a": [1, {"b": null}]}')]),
    ("granite", '[{"name":"f","arguments":{"x":"y"}}]', None, [("f", '{"x": "y"}')]),
    ("granite", 'It is [sunny].', 'It is [sunny].', []),
    ("granite-20b-fc", 'Sure. <function_call> {"name": "get_weather", "arguments": {"city": "Paris"}} '
     '<function_call>{"name": "get_time", "arguments": {}}', "Sure. ",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("granite-20b-fc", '<function_call> {"name": "f", "arguments": {"x": 1}} dropped', None, [("f", '{"x": 1}')]),
    ("granite-20b-fc", 'A <function no call.', 'A <function no call.', []),
    ("internlm", 'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
     '<|action_end|>\n', "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    ("internlm", '<|action_start|><|plugin|>{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),
    ("internlm", '<|action_start|><|plugin|>{"name": "f"}<|action_end|>', None, [("f", "{}")]),
    ("internlm", '<|action_start|><|interpreter|>print(1)<|action_end|>',
     '<|action_start|><|interpreter|>print(1)<|action_end|>', []),
]

MALFORMED = [
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut short
    ("llama3_json", '{"result": 4}'),  # JSON, but not a call
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}, "arguments": {}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}'),  # the array never closes
    ("pythonic", '[get_weather(city=Paris)]'),  # not a literal
    ("pythonic", '[get_weather(city="Paris")] and more'),
    ("pythonic", '[1, 2, 3]'),
    ("granite", '[{"name": "f"}]'),  # no arguments (vLLM's KeyError)
    ("granite", '[{"name": "f", "arguments": {}}] and more'),  # the reply must be the array
    ("granite", '<|tool_call|>{"name": "f", "arguments": {}}'),  # an object, not an array
    ("granite-20b-fc", 'Hi <function_call> {"name": "f"}'),  # no arguments
    ("granite-20b-fc", '<function_call> ["f"]'),
    ("internlm", '<|action_start|><|plugin|>{"name": "f", "parameters": {}} x<|action_end|>'),
    ("internlm", '<|action_start|><|plugin|><|action_end|>{"name": "f"}'),  # no object before the end marker
]


def _calls(tool_calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    found = get_tool_parser(name).extract(text)
    assert found.content == content and _calls(found.tool_calls) == calls
    for call in found.tool_calls:
        assert call["type"] == "function" and json.loads(call["function"]["arguments"]) is not None
        if name == "mistral":
            assert len(call["id"]) == 9 and call["id"].isalnum()
        else:
            assert call["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_stay_content(name, text):
    found = get_tool_parser(name).extract(text)
    assert found.content == text and found.tool_calls == []


def _stream(name: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """Feed pieces as a streamed reply; (content, calls, deltas) as a client puts them together."""
    stream = ToolCallStream(get_tool_parser(name))
    content, calls, deltas = "", [], []
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, final=k == len(pieces) - 1)
        deltas.append(delta)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if d["index"] == len(calls):
                assert d["type"] == "function" and d["id"] and d["function"]["name"]
                calls.append([d["function"]["name"], d["function"]["arguments"]])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(c) for c in calls], deltas


# Malformed replies found so before any call name is complete: the held-back text is released as content.
_MALFORMED_EARLY = [MALFORMED[1], MALFORMED[4], MALFORMED[9], MALFORMED[12], MALFORMED[14], MALFORMED[16]]


@pytest.mark.parametrize("name, text, content, calls", CASES + [(n, t, t, []) for n, t in _MALFORMED_EARLY])
def test_streaming_at_every_split_matches_the_full_reply(name, text, content, calls):
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text), [text]]
    for pieces in splits:
        assert _stream(name, pieces)[:2] == (content, calls), pieces


def test_a_call_found_malformed_after_its_name_was_streamed_stays_sent():
    name, text = MALFORMED[0]
    content, calls, _ = _stream(name, list(text))
    assert content == "Hi " and calls == [("get_weather", '{"city": ')]  # nothing is taken back, nothing added


def test_streamed_arguments_grow_before_the_call_ends():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _, calls, deltas = _stream("hermes", list(text))
    pieces = [d for delta in deltas for d in delta.get("tool_calls", [])]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and pieces[0]["index"] == 0
    assert len(pieces) > 5 and calls == [("get_weather", '{"city": "Paris"}')]
    # no content while a marker may be forming
    assert all("content" not in d for d in deltas)


def test_server_flags_are_checked():
    assert check_tool_options(False, None) is None
    assert check_tool_options(True, "hermes").name == "hermes"
    assert sorted(TOOL_PARSERS) == ["granite", "granite-20b-fc", "hermes", "internlm", "llama3_json", "mistral",
                                    "pythonic"]
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_options(True, None)
    with pytest.raises(ConfigError, match="'nope' is not one of"):
        check_tool_options(True, "nope")
    with pytest.raises(ConfigError, match="only with --enable-auto-tool-choice"):
        check_tool_options(False, "hermes")


def test_serve_refuses_a_bad_flag_combination_before_loading(tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["serve", str(tmp_path / "no-plan"), "--enable-auto-tool-choice"])
    assert result.exit_code == 1 and "ConfigError" in result.output and "--tool-call-parser" in result.output
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "no-plan"), "--enable-auto-tool-choice",
                                      "--tool-call-parser", "nope"])
    assert result.exit_code == 1 and "'nope' is not one of" in result.output


def test_special_markers_are_kept_only_where_the_tokenizer_hides_them():
    class Token:
        def __init__(self, content, special):
            self.content, self.special = content, special

    class Tok:
        all_special_tokens = ["</s>"]
        added_tokens_decoder = {5: Token("[TOOL_CALLS]", True), 6: Token("<tool_call>", False)}

    class InternLM2Tok:
        all_special_tokens = ["</s>", "<|action_start|>", "<|plugin|>", "<|action_end|>"]

    assert get_tool_parser("mistral").needs_special_tokens(Tok())
    assert not get_tool_parser("hermes").needs_special_tokens(Tok())
    assert not get_tool_parser("pythonic").needs_special_tokens(Tok())
    assert get_tool_parser("internlm").needs_special_tokens(InternLM2Tok())  # vLLM's adjust_request for internlm
    assert not get_tool_parser("granite").needs_special_tokens(InternLM2Tok())


# ---- the live server ------------------------------------------------------------------------------------------

def _live_server(tokenizer, executor, **options):
    """A live app over a scripted engine with these ServerOptions."""
    from live_server import app_in_thread
    from trtopt.serving.server import ServerOptions

    engine = scripted_engine(executor, tokenizer, max_model_len=512, max_num_seqs=4, num_blocks=256)
    return app_in_thread(engine, options=ServerOptions(**options))


@pytest.fixture(scope="module")
def hermes_server(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor, enable_auto_tool_choice=True, tool_call_parser="hermes",
                      trust_request_chat_template=True) as base:
        yield base, executor


@pytest.fixture(scope="module")
def plain_server(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor) as base:
        yield base, executor


def _client(base):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _ask(**extra):
    return dict(model="m", messages=[{"role": "user", "content": "Weather in Paris and the time?"}], tools=[WEATHER],
                temperature=0, max_tokens=200, **extra)


REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
REPLY_CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')]


def test_auto_tool_calls_full(hermes_server, smol_tokenizer):
    base, executor = hermes_server
    executor.say(smol_tokenizer.encode(REPLY, add_special_tokens=False))
    r = _client(base).chat.completions.create(**_ask())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == REPLY_CALLS
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_auto_tool_calls_streamed(hermes_server, smol_tokenizer):
    base, executor = hermes_server
    executor.say(smol_tokenizer.encode(REPLY, add_special_tokens=False))
    content, calls, finish, firsts = "", [], None, []
    for chunk in _client(base).chat.completions.create(**_ask(tool_choice="auto", stream=True)):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index == len(calls):
                firsts.append(d)
                calls.append([d.function.name, d.function.arguments or ""])
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check.\n" and [tuple(c) for c in calls] == REPLY_CALLS and finish == "tool_calls"
    assert all(d.id.startswith("chatcmpl-tool-") and d.type == "function" for d in firsts)


def _streamed(base, **extra) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, calls, finish_reason) of a streamed chat reply, as a client puts the deltas together."""
    content, calls, finish = "", [], None
    for chunk in _client(base).chat.completions.create(**_ask(stream=True, **extra)):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index == len(calls):
                assert d.id.startswith("chatcmpl-tool-") and d.type == "function"
                calls.append([d.function.name, d.function.arguments or ""])
            else:
                calls[d.index][1] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls], finish


# (parser, a reply in its model's syntax, its content): the calls are REPLY_CALLS
FAMILY_REPLIES = [
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None),
    ("granite-20b-fc", 'Let me check. <function_call> {"name": "get_weather", "arguments": {"city": "Paris"}} '
                       '<function_call> {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', "Let me check. "),
    ("internlm", 'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
                 '<|action_end|>', "Let me check."),
]


@pytest.mark.parametrize("parser, reply, content", FAMILY_REPLIES)
def test_granite_and_internlm_parsers_on_the_live_server(smol_tokenizer, parser, reply, content):
    """`--tool-call-parser granite|granite-20b-fc|internlm`: the whole and the streamed reply give the same calls."""
    calls = REPLY_CALLS[:1] if parser == "internlm" else REPLY_CALLS  # InternLM2 makes one call per reply
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor, enable_auto_tool_choice=True, tool_call_parser=parser) as base:
        executor.say(smol_tokenizer.encode(reply, add_special_tokens=False))
        choice = _client(base).chat.completions.create(**_ask()).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == calls
        executor.say(smol_tokenizer.encode(reply, add_special_tokens=False))
        assert _streamed(base) == (content or "", calls, "tool_calls")
        executor.say(smol_tokenizer.encode("It is sunny in Paris.", add_special_tokens=False))
        choice = _client(base).chat.completions.create(**_ask()).choices[0]
        assert choice.message.content == "It is sunny in Paris." and not choice.message.tool_calls


def test_a_reply_without_calls_is_content(hermes_server, smol_tokenizer):
    base, executor = hermes_server
    executor.say(smol_tokenizer.encode("It is sunny in Paris.", add_special_tokens=False))
    choice = _client(base).chat.completions.create(**_ask()).choices[0]
    assert choice.message.content == "It is sunny in Paris." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_choice_none_is_not_parsed(hermes_server, smol_tokenizer):
    base, executor = hermes_server
    executor.say(smol_tokenizer.encode(REPLY, add_special_tokens=False))
    choice = _client(base).chat.completions.create(**_ask(tool_choice="none")).choices[0]
    assert choice.message.content == REPLY and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_the_tools_reach_the_chat_template(hermes_server, smol_tokenizer):
    base, executor = hermes_server
    executor.say([])
    template = "{% for t in tools %}TOOL:{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    r = _client(base).chat.completions.create(**_ask(extra_body={"chat_template": template, "return_token_ids": True}))
    assert smol_tokenizer.decode(r.model_extra["prompt_token_ids"]).startswith("TOOL:get_weather;Weather")


def test_auto_without_the_flag_is_a_400_that_names_the_flags(plain_server):
    openai = pytest.importorskip("openai")
    base, _ = plain_server
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice --tool-call-parser"):
            _client(base).chat.completions.create(**_ask(**extra))


# ---- a tool loop: the reply's calls and the tools' results sent back ----------------------------------------------

LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "22C and sunny"},
]


def test_a_tool_loop_reaches_the_template_with_parsed_arguments(hermes_server, smol_tokenizer):
    """The assistant turn with `content: null` and its calls, then the tool's result, as OpenAI clients and agent
    frameworks send them: accepted, and the template sees the arguments as a mapping (as vLLM renders them)."""
    base, executor = hermes_server
    executor.say(smol_tokenizer.encode("It is 22C and sunny in Paris.", add_special_tokens=False))
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                "[{{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %};{% endfor %}")
    r = _client(base).chat.completions.create(
        model="m", messages=LOOP, tools=[WEATHER], temperature=0, max_tokens=50,
        extra_body={"chat_template": template, "return_token_ids": True})
    prompt = smol_tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert prompt == "user:Weather in Paris?;assistant:[get_weather city=Paris];tool:22C and sunny;"
    assert r.choices[0].message.content == "It is 22C and sunny in Paris." and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("message,match", [
    ({"role": "assistant", "content": None}, "content is required"),
    ({"role": "user", "content": None}, "content is required"),
    ({"role": "user", "content": "x", "tool_calls": LOOP[1]["tool_calls"]}, "only assistant messages"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "must be a JSON string"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}, "needs"),
])
def test_bad_tool_loop_messages_are_400s(hermes_server, message, match):
    openai = pytest.importorskip("openai")
    base, _ = hermes_server
    with pytest.raises(openai.BadRequestError, match=match):
        _client(base).chat.completions.create(model="m", messages=[LOOP[0], message], tools=[WEATHER], max_tokens=5)
