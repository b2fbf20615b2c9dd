"""The rest of the OpenAI/vLLM completions surface through the official `openai` client on the live tiny server:
logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, prompt_logprobs, echo and best_of.

The tiny model has random weights, so each check compares the server with itself (a run without the field) or
with what the field guarantees whatever the weights (a forced token, a banned one, the echoed prompt).
"""

from __future__ import annotations

import pytest

from live_server import MODEL

GREEDY = {"temperature": 0.0}
PROMPT = "The capital of France is"


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    forced = 1234
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logit_bias={str(forced): 100},
                                    extra_body={"ignore_eos": True}, temperature=1.0, seed=5)
    assert tokenizer(out.choices[0].text, add_special_tokens=False).input_ids == [forced] * 6
    # Of two allowed tokens, -100 on one leaves only the other, at any temperature.
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logit_bias={"22": -100}, temperature=1.0,
                                    seed=5, extra_body={"ignore_eos": True, "allowed_token_ids": [22, 33]})
    assert tokenizer(out.choices[0].text, add_special_tokens=False).input_ids == [33] * 6


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    allowed = [11, 22, 33]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert set(tokenizer(out.choices[0].text, add_special_tokens=False).input_ids) <= set(allowed)
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    # A word of the greedy text that vLLM's rule bans mid-text too (" word" has as many tokens as "word").
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    word = next(w for w in free.choices[0].text.split()[1:] if len(enc(" " + w)) == len(enc(w)) and enc(" " + w) != enc(w))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True, "bad_words": [word]}, **GREEDY)
    assert out.choices[0].text != free.choices[0].text and f" {word}" not in out.choices[0].text


def test_truncate_prompt_tokens_equals_the_cut_prompt(client, tokenizer):
    ids = tokenizer(PROMPT + " a very long way from here", add_special_tokens=False).input_ids
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3}, **GREEDY)
    ref = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert cut.choices[0].text == ref.choices[0].text and cut.usage.prompt_tokens == 3


def test_echo_prepends_the_prompt_with_its_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, echo=True,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    c = echo.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    n_prompt = echo.usage.prompt_tokens
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 5 and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


def test_prompt_logprobs_extra_field(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True, "prompt_logprobs": 1}, **GREEDY)
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == out.usage.prompt_tokens and plp[0] is None
    for row in plp[1:]:
        assert 1 <= len(row) <= 2 and all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in row.values())
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    # The prompt token's own entry comes first in each row; echo reports the same numbers.
    assert echo.choices[0].logprobs.token_logprobs[1 : len(plp)] == pytest.approx(
        [next(iter(row.values()))["logprob"] for row in plp[1:]], abs=1e-5)


def test_best_of_returns_the_n_most_likely(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    pool = client.completions.create(n=4, logprobs=0, **kw)
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(pool.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
