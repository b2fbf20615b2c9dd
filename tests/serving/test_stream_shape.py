"""vLLM's stream shape and stop-token text, on the real app over a scripted engine (SmolLM2's tokenizer, a known
reply, then EOS), read as raw JSON so that exactly what goes over the wire is checked:

- no parser: one chunk per generated token, `delta: {"content": ...}` even when the text is held back ("" while a
  character is incomplete), the last with the finish_reason (vLLM's DeltaMessage(content=delta_text));
- a parser (reasoning, auto tool calls): no chunk while it holds text back (vLLM's None delta), an empty
  `delta: {}` only on the finishing chunk or with return_token_ids; logprobs and token ids held back go with the
  next chunk, so none are lost;
- the stop token's text (EOS, stop_token_ids) is left out unless include_stop_str_in_output, also with
  skip_special_tokens=False (vLLM's detokenizer rule).
"""

from __future__ import annotations

import json

import pytest

from scripted import EOS, ScriptedExecutor, scripted_engine
from trtopt.runtime.input_processor import ChatPrompt
from trtopt.runtime.sampling_params import SamplingParams

USER = [{"role": "user", "content": "Hi!"}]
PARROT = "Hello 🦜 there!"  # the parrot is three byte tokens: the first two decode to an incomplete character
THINKING = "<think>Say hi.</think>Hi!"


@pytest.fixture(scope="module")
def scripted(smol_tokenizer):
    executor = ScriptedExecutor()
    engine = scripted_engine(executor, smol_tokenizer, max_model_len=256, num_blocks=128)
    prompt_len = len(engine.input_processor.process(ChatPrompt(USER), SamplingParams()).prompt_token_ids)
    return engine, executor, prompt_len


@pytest.fixture(scope="module")
def apps(scripted):
    """apps(parser) -> a TestClient on the real app with that --reasoning-parser (None: none), lifespan running."""
    from starlette.testclient import TestClient

    from trtopt.serving.server import ServerOptions, create_app

    engine, _, _ = scripted
    opened: dict[str | None, TestClient] = {}

    def app_for(parser: str | None) -> TestClient:
        if parser not in opened:
            opened[parser] = TestClient(create_app(engine, "m", options=ServerOptions(reasoning_parser=parser)))
            opened[parser].__enter__()
        return opened[parser]

    yield app_for
    for client in opened.values():
        client.__exit__(None, None, None)


@pytest.fixture
def say(scripted, smol_tokenizer):
    """say(text) -> the reply's token ids (EOS follows them)."""
    _, executor, prompt_len = scripted

    def set_reply(text: str) -> list[int]:
        ids = smol_tokenizer(text, add_special_tokens=False).input_ids
        executor.say(ids, prompt_len=prompt_len)
        return ids

    return set_reply


def _chunks(client, **body) -> list[dict]:
    """The JSON chunks of a streamed chat reply ([DONE] checked and dropped), the role chunk first."""
    with client.stream("POST", "/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0,
                                                              "max_tokens": 64, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _chat(client, **body) -> dict:
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0,
                                                     "max_tokens": 64, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_without_a_parser_every_token_is_a_content_chunk(apps, say):
    ids = say(PARROT)
    chunks = _chunks(apps(None))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert len(deltas) == len(ids) + 1  # the reply's tokens, then EOS (whose text is left out)
    assert all(set(d) == {"content"} for d in deltas)
    assert "".join(d["content"] for d in deltas) == PARROT
    assert [d["content"] for d in deltas[1:4]] == ["", "", " 🦜"]  # its first two byte tokens show nothing
    assert deltas[-1] == {"content": ""} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_parser_sends_no_empty_delta_before_the_last_chunk(apps, say):
    ids = say(THINKING)
    chunks = _chunks(apps("deepseek_r1"))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert all(deltas[:-1]) and len(deltas) < len(ids)  # the tags' tokens were held back, never sent as {}
    assert "".join(d.get("reasoning", "") for d in deltas) == "Say hi."
    assert "".join(d.get("content", "") for d in deltas) == "Hi!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_held_back_tokens_keep_their_logprobs_and_ids(apps, say):
    ids = say(THINKING)
    chunks = _chunks(apps("deepseek_r1"), logprobs=True)
    content = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == len(ids) + 1  # every token, EOS included, though fewer chunks were sent
    chunks = _chunks(apps("deepseek_r1"), return_token_ids=True)
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == ids + [EOS]
    assert len(chunks) == len(ids) + 2  # with token ids, every token is a chunk (an empty delta where held back)
    assert {} in [c["choices"][0]["delta"] for c in chunks[1:-1]]


@pytest.mark.parametrize("extra, text", [
    ({}, "Hello there!"),
    ({"skip_special_tokens": False}, "Hello there!"),  # vLLM: EOS is a stop token, left out of the text
    ({"skip_special_tokens": False, "include_stop_str_in_output": True}, "Hello there!<|im_end|>"),
    ({"include_stop_str_in_output": True}, "Hello there!"),  # its text is "" when special tokens are skipped
    ({"stop_token_ids": [665]}, "Hello"),  # " there": a plain token as a stop id, left out too
    ({"stop_token_ids": [665], "include_stop_str_in_output": True}, "Hello there"),
])
def test_the_stop_tokens_text_shows_only_with_include_stop_str_in_output(apps, say, extra, text):
    ids = say("Hello there!")
    full = _chat(apps(None), return_token_ids=True, **extra)
    choice = full["choices"][0]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"
    stop_id = extra.get("stop_token_ids", [EOS])[0]
    assert choice["token_ids"] == (ids[:ids.index(stop_id) + 1] if stop_id in ids else ids + [EOS])  # kept
    assert choice["stop_reason"] == (stop_id if stop_id != EOS else None)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in _chunks(apps(None), **extra))
    assert streamed == text
