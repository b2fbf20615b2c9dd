"""The official `openai` client against a live `trtopt serve` (tiny-llama, random weights, SmolLM2 tokenizer).

Random weights rarely emit EOS, so greedy requests set ignore_eos and get exactly max_tokens tokens; the checks
cross-examine the server against itself and the offline tokenizer: streamed == non-streamed, chat == completion
of the rendered template, stop cuts exactly, greedy picks the argmax of the reported logprobs.
"""

from __future__ import annotations

import math

import pytest

from live_server import API_KEY, MODEL

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    card = client.models.list().data[0].model_dump()  # vLLM's ModelCard fields, which its clients read
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 512
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]


def test_completion_greedy_streamed_equals_non_streamed(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_equals_completion_of_rendered_template(client, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    plain = client.completions.create(model=MODEL, prompt=rendered, max_tokens=10, **GREEDY)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(tokenizer(rendered).input_ids)


def test_chat_stream_with_usage(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n2_gives_two_different_seeded_completions(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=123,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)], "a seed makes sampling reproducible"
    assert texts[0] != texts[1], "completion i samples with seed + i"
    assert first.usage.completion_tokens == 16


def test_n2_streamed_chat_has_both_indices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, n=2, stream=True, temperature=1.0, seed=7,
                                                 extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string_cuts_the_text(client):
    prompt = "My favourite colours are"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    words = free.split()
    assert len(words) >= 4, f"need a few words to pick a stop string from: {free!r}"
    stop = " " + words[2]
    cut = free[: free.index(stop)]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY).choices[0]
    assert got.text == cut
    assert got.finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=stop, stream=True,
                                              **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_completion_logprobs_greedy_picks_the_argmax(client):
    resp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, logprobs=3, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and chosen <= 0
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5), "greedy takes the most likely token"


def test_chat_logprobs_and_top_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three."}],
                                          max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)
        assert bytes(t.bytes).decode() == t.token


def test_streamed_logprobs_match_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="Numbers:", max_tokens=5, logprobs=1, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.token_logprobs)


def test_greedy_chat_equals_hf_transformers(client, tokenizer):
    """End to end through HTTP: the served plan answers exactly as HF transformers' greedy generate does."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtopt.export.models import resolve_model

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, logprobs=True,
                                            **GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = hf.generate(**ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = out[0, ids["input_ids"].shape[1]:].tolist()
    assert served.usage.prompt_tokens == ids["input_ids"].shape[1]
    assert served.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert [t.token for t in served.choices[0].logprobs.content] == [tokenizer.decode([t]) for t in expected]


def test_batched_prompts_give_n_choices_per_prompt(client):
    prompts = ["The capital of France is", "Once upon a time"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, **GREEDY)
    choices = sorted(batch.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    expected = [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2  # greedy: both of n agree
    assert [c.text for c in choices] == expected
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 24
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == expected


def test_tokenize_and_detokenize_follow_vllm(server, tokenizer):
    import httpx

    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True},
                   headers=auth, timeout=30).json()
    assert r["tokens"] == tokenizer("Hello there").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "Hi!"}]
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, headers=auth, timeout=30).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["token_strs"] is None and tokenizer.decode(chat["tokens"]) == rendered
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}, headers=auth, timeout=30).json()
    assert back == {"prompt": tokenizer.decode(r["tokens"])}
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**9]}, headers=auth, timeout=30)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    both = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "a", "messages": messages}, headers=auth, timeout=30)
    assert both.status_code == 400
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
