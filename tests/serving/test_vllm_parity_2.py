"""More of vLLM's server behaviour, found by running vLLM's own server tests against `trtopt serve`: any chat role
reaches the chat template (test_chat.py::test_custom_role), and --enable-request-id-headers
(test_optional_middleware.py). On the live HTTP server (uvicorn) over the scripted, model-free engine."""

from __future__ import annotations


import httpx
import pytest

from scripted import ScriptedExecutor, scripted_engine

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _live_server(tokenizer, executor, *, api_key=None, **options):
    """A live app over a scripted engine (a 4 KiB body limit) with these ServerOptions."""
    from live_server import app_in_thread
    from trtopt.serving.server import ServerOptions

    engine = scripted_engine(executor, tokenizer, max_model_len=512, max_num_seqs=4, num_blocks=256)
    return app_in_thread(engine, api_key=api_key, max_body_bytes=4096, options=ServerOptions(**options))


@pytest.fixture(scope="module")
def plain(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor, api_key=KEY) as base:
        yield base, executor


@pytest.fixture(scope="module")
def with_ids(smol_tokenizer):
    executor = ScriptedExecutor()
    with _live_server(smol_tokenizer, executor, api_key=KEY, enable_request_id_headers=True) as base:
        yield base, executor


def _chat(base: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


# ---- custom roles ------------------------------------------------------------------------------------------------


def test_a_custom_role_reaches_the_chat_template(plain, smol_tokenizer):
    """vLLM's CustomChatCompletionMessageParam: any role string goes to the template as it is; string content and
    text parts render the same prompt, so the replies agree (vLLM's test_custom_role)."""
    base, executor = plain
    executor.say(smol_tokenizer.encode("Two.", add_special_tokens=False))
    messages = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    expected = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>my-custom-role\nwhat is 1+1?" in expected
    replies = []
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        resp = _chat(base, [{"role": "my-custom-role", "content": content}])
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert smol_tokenizer.decode(body["prompt_token_ids"]) == expected
        replies.append(body["choices"][0]["message"]["content"])
    assert replies == ["Two.", "Two."]


def test_a_custom_role_is_the_reply_role_when_continued(plain, smol_tokenizer):
    """add_generation_prompt false: the reply's role is the last message's, a custom one too (vLLM's rule)."""
    base, executor = plain
    executor.say(smol_tokenizer.encode(" more", add_special_tokens=False))
    resp = _chat(base, [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Once"}],
                 add_generation_prompt=False, continue_final_message=True)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "narrator"


@pytest.mark.parametrize("message, match", [
    ({"role": 5, "content": "hi"}, "role"),  # a role is a string
    ({"content": "hi"}, "role"),  # and is required
    ({"role": "narrator"}, "content is required"),  # the shape of a message is checked as before
    ({"role": "narrator", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "only assistant messages"),
])
def test_the_message_shape_is_still_checked(plain, message, match):
    base, _ = plain
    resp = _chat(base, [message])
    assert resp.status_code == 400 and match in resp.json()["error"]["message"], resp.text


# ---- --enable-request-id-headers ---------------------------------------------------------------------------------


def test_no_request_id_header_by_default(plain):
    base, _ = plain
    assert "x-request-id" not in httpx.get(f"{base}/health", timeout=10).headers
    assert "x-request-id" not in httpx.get(f"{base}/health", headers={"X-Request-Id": "mine"}, timeout=10).headers


def test_every_response_carries_a_new_request_id(with_ids):
    """vLLM's test_enable_request_id_header: a 32-character id (uuid4 hex), a new one per response."""
    base, _ = with_ids
    ids = [httpx.get(f"{base}/health", timeout=10).headers["X-Request-Id"] for _ in range(2)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]


def test_the_clients_request_id_comes_back(with_ids, smol_tokenizer):
    """vLLM's test_custom_request_id_header, on every kind of response: health, a generation, a stream, and the
    401 and 413 answered before the app (the header is added outermost)."""
    base, executor = with_ids
    mine = {"X-Request-Id": "Custom"}
    assert httpx.get(f"{base}/health", headers=mine, timeout=10).headers["X-Request-Id"] == "Custom"
    executor.say(smol_tokenizer.encode("Hi.", add_special_tokens=False))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers={**AUTH, **mine}, timeout=60)
    assert resp.status_code == 200 and resp.headers["X-Request-Id"] == "Custom"
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, headers={**AUTH, **mine},
                      timeout=60) as streamed:
        assert streamed.status_code == 200 and streamed.headers["X-Request-Id"] == "Custom"
        assert "data: [DONE]" in list(streamed.iter_lines())
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers=mine, timeout=10)
    assert resp.status_code == 401 and resp.headers["X-Request-Id"] == "Custom"
    big = {**body, "messages": [{"role": "user", "content": "x" * 10_000}]}
    resp = httpx.post(f"{base}/v1/chat/completions", json=big, headers={**AUTH, **mine}, timeout=10)
    assert resp.status_code == 413 and resp.headers["X-Request-Id"] == "Custom"


def test_serve_has_the_flag():
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--enable-request-id-headers" in result.output
