"""vLLM's serving extras on the live HTTP server (uvicorn over a real LLMEngine with a model-free executor):
POST /v1/chat/completions/batch (vLLM's test_batched_chat_completions.py), ORCA load reports in the
`endpoint-load-metrics` header (test_orca_metrics.py), and a reasoning reply's grammar holding only after its
`</think>` (test_completion_with_function_calling.py::test_function_tool_use with enable_thinking).
"""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
import torch

from scripted import EOS, VOCAB, ModelFreeExecutor, ScriptedExecutor, scripted_engine

MODEL = "m"
WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]


class PositionExecutor(ModelFreeExecutor):
    """The token after position p is WORDS[(p + 1) % 8]: a reply depends on its prompt's length, so replies to
    prompts of different lengths differ. Records how many sequences each step ran (its logits rows)."""

    def __init__(self, tokenizer) -> None:
        self.ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS]
        assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in WORDS), "one token per word"
        self.rows_per_step: list[int] = []

    def reply(self, prompt_len: int, max_tokens: int) -> str:
        return "".join(WORDS[(prompt_len + i) % len(WORDS)] for i in range(max_tokens))

    def next_ids(self, positions: list[int]) -> list[int]:
        self.rows_per_step.append(len(positions))
        return [self.ids[(p + 1) % len(self.ids)] for p in positions]


def _live_server(engine, **options):
    from live_server import app_in_thread
    from trtopt.serving.server import ServerOptions

    return app_in_thread(engine, MODEL, options=ServerOptions(**options))


@pytest.fixture(scope="module")
def positional(smol_tokenizer):
    executor = PositionExecutor(smol_tokenizer)
    engine = scripted_engine(executor, smol_tokenizer, max_model_len=512, max_num_seqs=8, num_blocks=256)
    with _live_server(engine) as base:
        yield base, executor


@pytest.fixture(scope="module")
def reasoning_servers(smol_tokenizer):
    """parser name -> (base url, its ScriptedExecutor), each a server with that --reasoning-parser."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for parser in ("deepseek_r1", "qwen3"):
            executor = ScriptedExecutor()
            engine = scripted_engine(executor, smol_tokenizer, max_model_len=512, max_num_seqs=8, num_blocks=256)
            servers[parser] = (stack.enter_context(_live_server(engine, reasoning_parser=parser)), executor)
        yield servers


def _post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": MODEL, **body}, timeout=60, **kw)


def _prompt_len(base: str, messages: list[dict]) -> int:
    return _post(base, "/tokenize", {"messages": messages}).json()["count"]


# ---- POST /v1/chat/completions/batch --------------------------------------------------------------------------------

CONVERSATIONS = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
                 [{"role": "user", "content": "Reply with exactly one word, the word: beta"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "gamma?"}]]


def test_batch_answers_each_conversation_in_order(positional):
    base, executor = positional
    lengths = [_prompt_len(base, c) for c in CONVERSATIONS]
    assert len(set(lengths)) == len(lengths), "distinct prompt lengths give distinct replies"
    r = _post(base, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-") and data["model"] == MODEL
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for choice, n in zip(data["choices"], lengths):
        assert choice["message"] == {"role": "assistant", "content": executor.reply(n, 3)}
        assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 9, "total_tokens": sum(lengths) + 9}
    # The same conversation alone gives the same reply.
    single = _post(base, "/v1/chat/completions", {"messages": CONVERSATIONS[1], "max_tokens": 3, "temperature": 0})
    assert single.json()["choices"][0]["message"]["content"] == data["choices"][1]["message"]["content"]


def test_batch_runs_its_conversations_in_one_continuous_batch(positional):
    """All conversations reach the engine together: some step runs every one of them (one after another, every
    step would run one)."""
    base, executor = positional
    executor.rows_per_step.clear()
    r = _post(base, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert max(executor.rows_per_step) == len(CONVERSATIONS)


def test_batch_echo_and_token_ids_are_per_conversation(positional):
    base, executor = positional
    conversations = [[{"role": "user", "content": "Say"}, {"role": "assistant", "content": "one"}],
                     [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "two"}]]
    body = {"messages": conversations, "max_tokens": 2, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    data = _post(base, "/v1/chat/completions/batch", body).json()
    for choice, conversation in zip(data["choices"], conversations):
        assert choice["message"]["content"].startswith(conversation[-1]["content"])
        assert len(choice["token_ids"]) == 2
    assert data["prompt_token_ids"] is None and data["prompt_logprobs"] is None


def test_batch_with_a_json_schema_gives_valid_json_per_conversation(positional):
    """vLLM's test_batched_chat_completions_with_json_schema: the grammar holds for every conversation (the
    executor's words never fit it, so every token is the grammar's)."""
    pytest.importorskip("xgrammar")
    base, _ = positional
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    body = {"messages": CONVERSATIONS[:2], "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                       "strict": True}}}
    r = _post(base, "/v1/chat/completions/batch", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("body, status, param, says", [
    ({"messages": []}, 400, "messages", "non-empty list of conversations"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "non-empty list of conversations"),
    ({"messages": "hi"}, 400, "messages", "non-empty list of conversations"),
    ({"messages": [[{"role": "user", "content": "hi"}], [{"role": "user"}]]}, 400, "messages.1.0", "content"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "stream": True}, 400, "stream", "does not support stream"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "n": 2}, 400, "n", "does not support n"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "use_beam_search": True}, 400, "use_beam_search",
     "do not support beam search"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 10**6}, 400, None, "max_tokens"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "model": "other"}, 404, "model", "does not exist"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "does not support tools"),
])
def test_bad_batches_are_4xx_with_an_openai_error_body(positional, body, status, param, says):
    base, _ = positional
    r = _post(base, "/v1/chat/completions/batch", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"], error


def test_batch_body_must_be_json(positional):
    base, _ = positional
    r = httpx.post(f"{base}/v1/chat/completions/batch", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions/batch", content=b"messages", timeout=10,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415


# ---- ORCA load reports ----------------------------------------------------------------------------------------------

def _named_metrics(header: str) -> dict[str, float]:
    kind, _, payload = header.partition(" ")
    if kind == "JSON":
        return json.loads(payload)["named_metrics"]
    assert kind == "TEXT", header
    pairs = [item.split("=") for item in payload.split(", ")]
    assert all(k.startswith("named_metrics.") for k, _ in pairs), header
    return {k[len("named_metrics."):]: float(v) for k, v in pairs}


@pytest.mark.parametrize("fmt", ["TEXT", "JSON", "json", "Text"])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "what is 1+1?"}], "max_tokens": 2}),
])
def test_orca_header_reports_the_engines_load(positional, fmt, path, body):
    base, _ = positional
    r = _post(base, path, body, headers={"endpoint-load-metrics-format": fmt})
    assert r.status_code == 200, r.text
    header = r.headers["endpoint-load-metrics"]
    assert header.startswith(fmt.upper() + " ")
    metrics = _named_metrics(header)
    assert set(metrics) == {"kv_cache_usage_perc", "num_requests_waiting", "num_requests_running"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert 0.0 <= metrics["kv_cache_usage_perc"] <= 1.0 and metrics["num_requests_waiting"] == 0.0


def test_orca_header_only_when_asked_in_a_known_format(positional):
    base, _ = positional
    body = {"prompt": "Hello", "max_tokens": 1}
    assert "endpoint-load-metrics" not in _post(base, "/v1/completions", body).headers
    assert "endpoint-load-metrics" not in _post(base, "/v1/completions", body,
                                                headers={"endpoint-load-metrics-format": "XML"}).headers
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": MODEL, **body, "stream": True}, timeout=30,
                      headers={"endpoint-load-metrics-format": "TEXT"}) as r:
        assert "endpoint-load-metrics" not in r.headers  # vLLM's: streams carry none
        r.read()


def test_orca_report_is_the_engines_state():
    """The report's values are the engine's gauges (the same ones /metrics shows)."""
    from trtopt.runtime.batch import EngineStats
    from trtopt.serving.metrics import orca_headers

    stats = EngineStats(num_running=3, num_waiting=2, num_blocks_total=40, num_blocks_free=30, num_preemptions=0,
                        num_steps=0, num_prompt_tokens=0, num_computed_prompt_tokens=0, num_generated_tokens=0,
                        num_prefix_cache_hit_tokens=0)
    text = orca_headers("TEXT", lambda: stats)["endpoint-load-metrics"]
    assert text == ("TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=2.0, "
                    "named_metrics.num_requests_running=3.0")
    assert json.loads(orca_headers("JSON", lambda: stats)["endpoint-load-metrics"][5:]) == {
        "named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 2.0, "num_requests_running": 3.0}}
    assert orca_headers("", lambda: stats) is None and orca_headers(None, lambda: stats) is None


# ---- reasoning before the grammar -----------------------------------------------------------------------------------

def test_a_gated_grammar_holds_only_after_the_reasoning_end(smol_tokenizer):
    pytest.importorskip("xgrammar")
    from trtopt.runtime.request import Request
    from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams
    from trtopt.runtime.structured_output import GrammarCompiler, GrammarMasker, GrammarMatcher, ReasoningGatedGrammar

    compiled = GrammarCompiler(smol_tokenizer, VOCAB, (EOS,)).compile(StructuredOutputsParams(choice=("yes", "no")))
    end = tuple(smol_tokenizer.encode("</think>", add_special_tokens=False))
    matcher = GrammarMatcher(ReasoningGatedGrammar(compiled, reasoning_end_ids=end))
    req = Request("r", [1, 2, 3], SamplingParams(), max_model_len=64)
    req.grammar = matcher
    free = smol_tokenizer.encode("Anything at all, even </thi", add_special_tokens=False)
    for token in free + list(end[:-1]):
        assert matcher.accept(token) and matcher.is_reasoning and not matcher.constrains
        logits = torch.randn(1, VOCAB)
        masked = logits.clone()
        GrammarMasker()(masked, [req])
        assert torch.equal(masked, logits)  # no mask while reasoning
    assert matcher.accept(end[-1]) and not matcher.is_reasoning and matcher.constrains
    masked = torch.zeros(1, VOCAB)
    GrammarMasker()(masked, [req])
    allowed = {t for t in range(VOCAB) if masked[0, t] > float("-inf")}
    assert allowed and all(any(w.startswith(smol_tokenizer.decode([t])) for w in ("yes", "no")) for t in allowed)
    assert not matcher.accept(smol_tokenizer.encode(" maybe", add_special_tokens=False)[0])
    ungated = GrammarMatcher(compiled)
    assert not ungated.is_reasoning and ungated.constrains and ungated.opening is None


def test_a_reply_that_may_open_its_reasoning_gets_the_tag_or_the_grammar(smol_tokenizer):
    """qwen3's gate: the first token is the grammar's or <think>'s first; once the tag is begun it must be finished,
    then the reply reasons; a reply that starts otherwise is the grammar's from that token."""
    pytest.importorskip("xgrammar")
    from trtopt.runtime.request import Request
    from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams
    from trtopt.runtime.structured_output import GrammarCompiler, GrammarMasker, GrammarMatcher, ReasoningGatedGrammar

    compiled = GrammarCompiler(smol_tokenizer, VOCAB, (EOS,)).compile(StructuredOutputsParams(choice=("yes", "no")))
    start, end = (tuple(smol_tokenizer.encode(t, add_special_tokens=False)) for t in ("<think>", "</think>"))
    assert len(start) > 1, "SmolLM2 spells <think> in several tokens: the tag is held to the end"
    gated = ReasoningGatedGrammar(compiled, reasoning_end_ids=end, reasoning_start_ids=start)

    def allowed(matcher) -> set[int]:
        req = Request("r", [1, 2, 3], SamplingParams(), max_model_len=64)
        req.grammar = matcher
        masked = torch.zeros(1, VOCAB)
        GrammarMasker()(masked, [req])
        return {t for t in range(VOCAB) if masked[0, t] > float("-inf")}

    grammar_first = allowed(GrammarMatcher(compiled))
    thinking = GrammarMatcher(gated)
    assert allowed(thinking) == grammar_first | {start[0]}
    for i, token in enumerate(start):
        if i:
            assert allowed(thinking) == {token}  # a begun tag is finished
        assert thinking.accept(token)
    assert thinking.is_reasoning and thinking.opening is None and not thinking.constrains
    for token in end:
        assert thinking.accept(token)
    assert allowed(thinking) == grammar_first
    plain = GrammarMatcher(gated)
    yes = smol_tokenizer.encode("yes", add_special_tokens=False)[0]
    assert plain.accept(yes) and not plain.is_reasoning and plain.opening is None
    assert not plain.accept(start[0])  # the grammar holds: "<" is not a choice


USER = [{"role": "user", "content": "Is the sky blue?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _say(executor: ScriptedExecutor, tokenizer, *pieces: str) -> None:
    """The scripted reply: each piece tokenized on its own (so "</think>" is exactly its tag's ids)."""
    executor.say([t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False)])


def _full_and_streamed(base: str, body: dict) -> tuple[dict, list[dict]]:
    """(the non-streamed message, the streamed deltas) of one chat request."""
    full = _post(base, "/v1/chat/completions", body)
    assert full.status_code == 200, full.text
    deltas = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                deltas += [{**c["delta"], "finish_reason": c["finish_reason"]} for c in chunk["choices"]]
    return full.json()["choices"][0], deltas


@pytest.mark.parametrize("parser, opening", [("deepseek_r1", ""), ("qwen3", "<think>")])
def test_structured_output_applies_after_the_reasoning(reasoning_servers, smol_tokenizer, parser, opening):
    """The reply reasons freely (the grammar would forbid every reasoning token), then the grammar holds: the
    scripted "Yes, it is!" after </think> is not a choice, so the content is the grammar's yes or no."""
    pytest.importorskip("xgrammar")
    base, executor = reasoning_servers[parser]
    _say(executor, smol_tokenizer, opening, "The sky scatters blue light.", "</think>", "Yes, it is!")
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}
    choice, deltas = _full_and_streamed(base, body)
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "The sky scatters blue light."
    assert message["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_a_qwen3_reply_without_think_is_the_grammars_from_its_first_token(reasoning_servers, smol_tokenizer):
    """qwen3: the model opens its reasoning itself; a reply that does not start with <think> has none (trtopt's
    qwen3 split: all content), so the grammar holds from its first token, and the reply cannot wander off."""
    pytest.importorskip("xgrammar")
    base, executor = reasoning_servers["qwen3"]
    _say(executor, smol_tokenizer, "no", " way, it is green!")  # the grammar's first token, then words it forbids
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}
    choice, deltas = _full_and_streamed(base, body)
    assert choice["message"]["content"] == "no" and choice["message"]["reasoning"] is None
    assert choice["finish_reason"] == "stop" and not any(d.get("reasoning") for d in deltas)


def test_thinking_off_applies_the_grammar_from_the_first_token(reasoning_servers, smol_tokenizer):
    pytest.importorskip("xgrammar")
    base, executor = reasoning_servers["qwen3"]
    _say(executor, smol_tokenizer, "<think>Hmm.", "</think>", "Yes!")
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]},
            "chat_template_kwargs": {"enable_thinking": False}}
    message = _post(base, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and message["reasoning"] is None


@pytest.mark.parametrize("tool_choice, content", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
])
@pytest.mark.parametrize("parser, opening", [("deepseek_r1", ""), ("qwen3", "<think>")])
def test_a_forced_tool_call_comes_after_the_reasoning(reasoning_servers, smol_tokenizer, parser, opening,
                                                      tool_choice, content):
    """vLLM's test_function_tool_use with enable_thinking: the message has both its reasoning and its calls,
    streamed as reasoning deltas, then tool-call deltas; the reasoning never reaches the call's arguments."""
    pytest.importorskip("xgrammar")
    base, executor = reasoning_servers[parser]
    _say(executor, smol_tokenizer, opening, "I should call get_weather.", "</think>", content)
    body = {"messages": USER, "max_tokens": 60, "temperature": 0, "tools": [TOOL], "tool_choice": tool_choice}
    choice, deltas = _full_and_streamed(base, body)
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I should call get_weather."
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    streamed = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert streamed and streamed[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in streamed)) == {"city": "Paris"}
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert not any(d.get("reasoning") for d in deltas[first_call:])  # the reasoning came first
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
