"""Reasoning parsers (`--reasoning-parser`, trtopt.serving.reasoning) and chat `prompt_logprobs`.

The parsers: their rules on whole replies, and streaming cut at every character boundary (and in random pieces)
giving exactly the whole-reply split. The server: a model-free executor that replays a scripted reply (SmolLM2 does
not think) under an LLMEngine with SmolLM2's tokenizer, served by the real app through the official `openai` client;
the tags span several tokens there, so the stream splits them. Chat prompt_logprobs run on the live tiny server.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from live_server import API_KEY, MODEL
from scripted import ScriptedExecutor, scripted_engine
from trtopt.errors import ConfigError
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.input_processor import ChatPrompt
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.reasoning import REASONING_PARSERS, ReasoningRule, ReasoningSplit, get_reasoning_parser

DEEPSEEK = get_reasoning_parser("deepseek_r1").rule()
QWEN3 = get_reasoning_parser("qwen3").rule()
QWEN3_OFF = get_reasoning_parser("qwen3").rule({"enable_thinking": False})

# (text, deepseek_r1's split, qwen3's split)
CASES = [
    ("<think>Greet back.</think>Hello!", ReasoningSplit("Greet back.", "Hello!"), ReasoningSplit("Greet back.", "Hello!")),
    ("Greet back.</think>Hello!", ReasoningSplit("Greet back.", "Hello!"), ReasoningSplit(None, "Greet back.</think>Hello!")),
    ("Still thinking", ReasoningSplit("Still thinking", None), ReasoningSplit(None, "Still thinking")),
    ("<think>Cut short", ReasoningSplit("Cut short", None), ReasoningSplit("Cut short", None)),
    ("<think>r</think>", ReasoningSplit("r", None), ReasoningSplit("r", None)),
    ("</think>Just content", ReasoningSplit("", "Just content"), ReasoningSplit(None, "</think>Just content")),
    ("", ReasoningSplit("", None), ReasoningSplit(None, "")),
    ("a <thin b </thi c", ReasoningSplit("a <thin b </thi c", None), ReasoningSplit(None, "a <thin b </thi c")),
    ("<<think>>x<</think>>", ReasoningSplit("<>x<", ">"), ReasoningSplit(">x<", "<>")),
    # Only the first </think> ends reasoning (qwen3: the first after <think>); tags after it are content.
    ("r</think>c <think>x</think>", ReasoningSplit("r", "c <think>x</think>"), ReasoningSplit("x", "r</think>c ")),
    # deepseek_r1 drops one <think> the model writes itself; text before it stays reasoning (qwen3: content).
    ("\n<think>r</think>c", ReasoningSplit("\nr", "c"), ReasoningSplit("r", "\nc")),
    ("<think><think>r</think>c", ReasoningSplit("<think>r", "c"), ReasoningSplit("<think>r", "c")),
]


def _streamed(rule: ReasoningRule, pieces: list[str]) -> tuple[list[str], list[str]]:
    """(reasoning deltas, content deltas) of a reply streamed in `pieces` (finish() with the last one)."""
    stream = rule.stream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return [d.reasoning for d in deltas], [d.content for d in deltas]


def _joined(rule: ReasoningRule, pieces: list[str]) -> tuple[str, str]:
    """(reasoning, content) as a client joins the streamed deltas."""
    reasoning, content = _streamed(rule, pieces)
    return "".join(reasoning), "".join(content)


def _as_joined(split: ReasoningSplit) -> tuple[str, str]:
    return split.reasoning or "", split.content or ""


@pytest.mark.parametrize("text, deepseek, qwen3", CASES)
def test_whole_reply_splits(text, deepseek, qwen3):
    assert DEEPSEEK.split(text) == deepseek
    assert QWEN3.split(text) == qwen3
    assert QWEN3_OFF.split(text) == ReasoningSplit(None, text)  # enable_thinking=false: no reasoning at all


@pytest.mark.parametrize("rule", [DEEPSEEK, QWEN3, QWEN3_OFF], ids=["deepseek_r1", "qwen3", "qwen3-off"])
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_stream_cut_at_every_boundary_equals_the_whole_reply(rule, text):
    whole = rule.split(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for pieces in cuts + [list(text)]:
        assert _joined(rule, pieces) == _as_joined(whole), pieces


@pytest.mark.parametrize("rule", [DEEPSEEK, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_streamed_reasoning_comes_before_content_and_tags_never_show(rule):
    text = "<think>Let me think: 2 + 2 = 4.</think>The answer is 4."
    reasoning, content = _streamed(rule, list(text))
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    first_content = min(i for i, c in enumerate(content) if c)
    assert last_reasoning < first_content
    assert not any("<think>" in d or "</think>" in d for d in reasoning + content)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", "</", "<th", "ink>", " "]),
                max_size=12),
       st.lists(st.integers(0, 40), max_size=6))
def test_any_text_in_any_pieces_equals_the_whole_reply(words, cut_points):
    text = "".join(words)
    cuts = sorted({min(c, len(text)) for c in cut_points})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for rule in (DEEPSEEK, QWEN3, QWEN3_OFF):
        assert _joined(rule, pieces) == _as_joined(rule.split(text))


def test_registry_has_vllms_names_and_refuses_others():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ConfigError, match=r"'deepseek' is not one of \['deepseek_r1', 'qwen3'\]"):
        get_reasoning_parser("deepseek")
    assert QWEN3 == get_reasoning_parser("qwen3").rule({"enable_thinking": True}) != QWEN3_OFF


def test_serve_refuses_an_unknown_parser_at_start_up(tmp_path):
    from trtopt.cli.main import app

    # Checked before the plan is loaded: no plan needed to see the error.
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "no-plan"), "--reasoning-parser", "r1"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "ConfigError" in result.output and "'r1' is not one of ['deepseek_r1', 'qwen3']" in result.output


# ---- the server, on a scripted reply -------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hi!"}]
REPLY = "<think>The user greets me. I greet back.</think>Hello! How can I help?"


@pytest.fixture(scope="module")
def scripted(smol_tokenizer) -> tuple[LLMEngine, ScriptedExecutor]:
    executor = ScriptedExecutor()
    llm = scripted_engine(executor, smol_tokenizer, max_model_len=256, max_num_seqs=8, num_blocks=128)
    executor.prompt_len = len(llm.input_processor.process(ChatPrompt(USER), SamplingParams()).prompt_token_ids)
    return llm, executor


@pytest.fixture
def reply(scripted, smol_tokenizer):
    """Set the scripted reply: reply(text) -> its token ids."""
    _, executor = scripted

    def set_reply(text: str) -> list[int]:
        ids = smol_tokenizer(text, add_special_tokens=False).input_ids
        assert smol_tokenizer.decode(ids) == text
        executor.say(ids, prompt_len=executor.prompt_len)
        return ids

    return set_reply


def _app_client(scripted, parser: str | None):
    """(openai client, TestClient) on the real app over the scripted engine."""
    import openai
    from starlette.testclient import TestClient

    from trtopt.serving.server import ServerOptions, create_app

    llm, _ = scripted
    test_client = TestClient(create_app(llm, MODEL, options=ServerOptions(reasoning_parser=parser)))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=test_client,
                         max_retries=0), test_client


@pytest.fixture
def serve(scripted):
    """serve(parser) -> the official openai client on an app with that --reasoning-parser (None: no parser)."""
    opened = []

    def open_app(parser: str | None):
        client, test_client = _app_client(scripted, parser)
        test_client.__enter__()  # runs the lifespan: the engine loop starts
        opened.append(test_client)
        return client

    yield open_app
    for test_client in opened:
        test_client.__exit__(None, None, None)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=USER, temperature=0.0, **{"max_tokens": 64, **kw})


def _stream_deltas(client, **kw) -> list[dict]:
    """Each streamed delta of choice 0 (as a dict, extra fields included)."""
    chunks = list(_chat(client, stream=True, **kw))
    return [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices and c.choices[0].index == 0]


def _reasoning(message) -> str | None:
    """The reasoning, under both names trtopt sends (current vLLM's `reasoning`, older `reasoning_content`)."""
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning_content")


def test_deepseek_r1_splits_the_reply(serve, reply):
    reply(REPLY)
    client = serve("deepseek_r1")
    out = _chat(client)
    message = out.choices[0].message
    assert _reasoning(message) == "The user greets me. I greet back." and message.content == "Hello! How can I help?"
    assert out.choices[0].finish_reason == "stop"
    # The reply without the <think> the model usually leaves to the template: the same split.
    reply(REPLY.removeprefix("<think>"))
    message = _chat(client).choices[0].message
    assert (_reasoning(message), message.content) == ("The user greets me. I greet back.", "Hello! How can I help?")


def test_streamed_reasoning_then_content_equals_the_full_reply(serve, reply):
    reply(REPLY)
    client = serve("deepseek_r1")
    deltas = _stream_deltas(client)
    reasoning = [d.get("reasoning_content", "") for d in deltas]
    assert reasoning == [d.get("reasoning", "") for d in deltas]
    content = [d.get("content", "") for d in deltas]
    assert "".join(reasoning) == "The user greets me. I greet back." and "".join(content) == "Hello! How can I help?"
    assert max(i for i, r in enumerate(reasoning) if r) < min(i for i, c in enumerate(content) if c)
    assert not any("think>" in piece for piece in reasoning + content)
    assert sum(1 for r in reasoning if r) > 3, "reasoning streams in pieces, not in one chunk at the end"


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_reply_cut_anywhere_splits_the_same_streamed_or_not(serve, reply, parser):
    ids = reply("<think>Greet.</think>Hi!")  # short: two requests per cut
    client = serve(parser)
    for max_tokens in range(1, len(ids) + 2):
        full = _chat(client, max_tokens=max_tokens).choices[0].message
        deltas = _stream_deltas(client, max_tokens=max_tokens)
        streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        streamed_content = "".join(d.get("content", "") for d in deltas)
        assert (_reasoning(full) or "", full.content or "") == (streamed_reasoning, streamed_content), max_tokens


def test_qwen3_reasons_only_after_think_and_not_when_disabled(serve, reply):
    reply(REPLY)
    client = serve("qwen3")
    message = _chat(client).choices[0].message
    assert (_reasoning(message), message.content) == ("The user greets me. I greet back.", "Hello! How can I help?")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _chat(client, extra_body=off).choices[0].message
    assert _reasoning(message) is None and message.content == REPLY
    assert "".join(d.get("content", "") for d in _stream_deltas(client, extra_body=off)) == REPLY
    reply("Hello! No thinking here.")
    message = _chat(client).choices[0].message
    assert _reasoning(message) is None and message.content == "Hello! No thinking here."


def test_every_choice_splits_on_its_own(serve, reply):
    reply(REPLY)
    client = serve("deepseek_r1")
    out = _chat(client, n=2)
    assert [(_reasoning(c.message), c.message.content) for c in out.choices] == [
        ("The user greets me. I greet back.", "Hello! How can I help?")] * 2
    chunks = list(_chat(client, n=2, stream=True))
    for index in (0, 1):
        deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user greets me. I greet back."
        assert "".join(d.get("content") or "" for d in deltas) == "Hello! How can I help?"


def test_without_a_parser_the_reply_is_untouched(serve, reply):
    reply(REPLY)
    client = serve(None)
    message = _chat(client).choices[0].message
    assert message.content == REPLY and not {"reasoning", "reasoning_content"} & set(message.model_extra or {})
    assert all(not {"reasoning", "reasoning_content"} & set(d) for d in _stream_deltas(client))


# Structured output and forced tool calls on a reasoning reply (the grammar holds after </think>, as in vLLM):
# tests/serving/test_vllm_endpoints.py.


def test_a_grammar_without_reasoning_is_all_content(serve, reply):
    """qwen3 with thinking off: no reasoning to split off, so the grammar holds from the first token."""
    pytest.importorskip("xgrammar")
    reply(REPLY)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body = {"structured_outputs": {"choice": ["yes", "no"]}, **off}
    message = _chat(serve("qwen3"), extra_body=body).choices[0].message
    assert _reasoning(message) is None and message.content in ("yes", "no")


def test_create_app_refuses_an_unknown_parser(scripted):
    with pytest.raises(ConfigError, match="--reasoning-parser 'qwen' is not one of"):
        _app_client(scripted, "qwen")


# ---- chat prompt_logprobs on the live tiny server ------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def test_chat_prompt_logprobs_equal_the_completions_endpoints(server, client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.0,
                                         extra_body={"prompt_logprobs": 2})
    chat_rows = out.model_extra["prompt_logprobs"]
    ids = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert len(chat_rows) == len(ids) == out.usage.prompt_tokens and chat_rows[0] is None
    completion = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    rows = completion["choices"][0]["prompt_logprobs"]
    assert [None if r is None else set(r) for r in chat_rows] == [None if r is None else set(r) for r in rows]
    for chat_row, row, token in zip(chat_rows[1:], rows[1:], ids[1:]):
        assert str(token) in chat_row and 2 <= len(chat_row) <= 3  # the prompt token, then the top 2
        for key, entry in chat_row.items():
            assert entry["logprob"] == pytest.approx(row[key]["logprob"], abs=1e-5)
            assert entry["decoded_token"] == row[key]["decoded_token"]


def test_chat_prompt_logprobs_are_null_unless_asked(server):
    body = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert "prompt_logprobs" in body and body["prompt_logprobs"] is None
    assert all("prompt_logprobs" not in choice for choice in body["choices"])  # vLLM's place: the response


@pytest.mark.parametrize("extra, message", [
    ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": -1}, "Requested prompt logprobs of 49152"),  # the whole vocabulary, over the default cap
    ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_chat_prompt_logprobs_are_validated_as_completions(server, extra, message):
    resp = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra})
    assert resp.status_code == 400 and message in resp.json()["error"]["message"]
    if not extra.get("stream") and isinstance(extra["prompt_logprobs"], int):  # the completions endpoint agrees
        resp = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **extra})
        assert resp.status_code == 400 and message in resp.json()["error"]["message"]


def test_chat_stream_takes_prompt_logprobs_zero(server):
    """vLLM's rule: 0 is taken with stream (a stream has nowhere to put prompt logprobs, so none are sent)."""
    resp = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True,
                                                  "prompt_logprobs": 0})
    assert resp.status_code == 200 and "data: [DONE]" in resp.text and "prompt_logprobs" not in resp.text
