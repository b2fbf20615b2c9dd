"""vLLM's server behaviour found by reading run 3 of vLLM's own server tests against `trtopt serve`
(docs/benchmarks/vllm_server_suite.json): a request may leave out `model` (test_basic.py::test_server_load), a
completion's top_logprobs start with the position's own token (test_return_tokens_as_ids.py), a forced named call
cut short by max_tokens has no tool calls (test_completion_with_function_calling.py::
test_max_tokens_with_tool_choice_required), and Kimi-K2's tool call ids (::test_tool_id_kimi_k2). On the live app
over the scripted, model-free engine; the official openai client where it matters."""

from __future__ import annotations

import json

import httpx
import pytest

from scripted import ScriptedExecutor, scripted_engine

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _live_server(tokenizer, executor, **options):
    from live_server import app_in_thread
    from trtopt.serving.server import ServerOptions

    engine = scripted_engine(executor, tokenizer, max_model_len=512, max_num_seqs=4, num_blocks=256)
    return app_in_thread(engine, options=ServerOptions(**options))


@pytest.fixture(scope="module")
def plain(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor) as base:
        yield base, executor


@pytest.fixture(scope="module")
def kimi(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor, tool_call_id_type="kimi_k2") as base:
        yield base, executor


def _openai(base: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _say(executor: ScriptedExecutor, tokenizer, text: str) -> None:
    executor.say(tokenizer.encode(text, add_special_tokens=False))


# ---- model may be left out --------------------------------------------------------------------------------------


def test_a_request_without_model_is_served_by_the_served_model(plain, smol_tokenizer):
    base, executor = plain
    _say(executor, smol_tokenizer, " fine")
    completion = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
                            timeout=60)
    assert completion.status_code == 200 and completion.json()["model"] == "m"
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "m"
    wrong = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "Hi"}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


# ---- completion logprobs in vLLM's order --------------------------------------------------------------------------


@pytest.mark.parametrize("as_ids", [False, True])
def test_each_top_logprobs_row_starts_with_its_own_token(plain, smol_tokenizer, as_ids):
    """vLLM's test_completion_return_tokens_as_token_ids_completion: the prompt tokens (echo) are rarely the model's
    top-1, yet each row's first key is the token of its position; the others follow, best first."""
    base, executor = plain
    _say(executor, smol_tokenizer, " world")
    choice = _openai(base).completions.create(model="m", prompt="Say 'Hello, world! 🎉'", echo=True, temperature=0,
                                              max_tokens=2, logprobs=1,
                                              extra_body={"return_tokens_as_token_ids": as_ids}).choices[0]
    tokens, rows = choice.logprobs.tokens, choice.logprobs.top_logprobs
    assert rows[0] is None and tokens[1:] == [next(iter(row)) for row in rows[1:]]
    assert any(len(row) == 2 for row in rows[1:])  # some prompt token is not the top-1: it comes first anyway
    for token_logprob, row in zip(choice.logprobs.token_logprobs[1:], rows[1:]):
        own, *others = row.values()
        assert own == token_logprob and others == sorted(others, reverse=True)
    if as_ids:
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        assert choice.text == smol_tokenizer.decode(ids, skip_special_tokens=True)


# ---- forced tool calls cut short ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_cut_short_has_no_tool_calls(plain, smol_tokenizer, tool_choice):
    """max_tokens ends the call inside its JSON: finish_reason "length", content "" and no tool calls (OpenAI's
    answer, vLLM's test); a named call's stream did send the partial arguments, which cannot be taken back."""
    base, executor = plain
    _say(executor, smol_tokenizer, '{"city": "Paris"}' if isinstance(tool_choice, dict) else
         '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    client = _openai(base)
    kwargs = dict(model="m", messages=USER, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=3)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content == "" and choice.message.tool_calls == []
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.delta.tool_calls or []))
    assert chunks[-1].finish_reason == "length"
    assert (args != "") == isinstance(tool_choice, dict)


def test_a_forced_named_call_that_completes_is_still_a_call(plain, smol_tokenizer):
    base, executor = plain
    _say(executor, smol_tokenizer, '{"city": "Paris"}')
    choice = _openai(base).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")


# ---- Kimi-K2 tool call ids ---------------------------------------------------------------------------------------

CALLS = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                    {"name": "get_forecast", "parameters": {"days": 5}}])


@pytest.mark.parametrize("stream", [False, True])
def test_kimi_k2_ids_number_the_conversations_calls(kimi, smol_tokenizer, stream):
    """vLLM's test_tool_id_kimi_k2: functions.<name>:<index>; the index counts on from the calls the conversation's
    earlier assistant messages made (vLLM's get_history_tool_calls_cnt)."""
    base, executor = kimi
    client = _openai(base)
    earlier = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "cold"}]
    for history, first in (([], 0), (earlier, 1)):
        _say(executor, smol_tokenizer, CALLS)  # the reply after this prompt (its length is learnt anew)
        kwargs = dict(model="m", messages=USER + history, tools=[WEATHER, FORECAST], tool_choice="required",
                      temperature=0, max_tokens=80)
        if stream:
            ids = [tc.id for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []) if tc.id is not None]
        else:
            ids = [tc.id for tc in client.chat.completions.create(**kwargs).choices[0].message.tool_calls]
        assert ids == [f"functions.get_weather:{first}", f"functions.get_forecast:{first + 1}"]


def test_kimi_k2_ids_for_a_named_call_streamed_and_whole(kimi, smol_tokenizer):
    base, executor = kimi
    _say(executor, smol_tokenizer, '{"city": "Paris"}')
    client = _openai(base)
    kwargs = dict(model="m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0].id == "functions.get_weather:0"
    _say(executor, smol_tokenizer, '{"city": "Paris"}')
    ids = [tc.id for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
           for tc in (c.choices[0].delta.tool_calls or []) if tc.id is not None]
    assert ids == ["functions.get_weather:0"]


def test_tool_call_id_type_follows_vllms_model_types():
    from trtopt.errors import ConfigError
    from trtopt.serving.server import ServerOptions, create_app
    from trtopt.serving.tool_parsers import tool_call_id_type

    assert [tool_call_id_type(t) for t in ("kimi_k2", "kimi_k25", "llama", "")] == ["kimi_k2", "kimi_k2", "random",
                                                                                    "random"]
    executor = ScriptedExecutor()
    with pytest.raises(ConfigError, match="tool_call_id_type"):
        create_app(scripted_engine(executor, None), "m", options=ServerOptions(tool_call_id_type="sequential"))
