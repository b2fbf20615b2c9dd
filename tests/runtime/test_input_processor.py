"""InputProcessor: every prompt form to the same token ids under one BOS rule, and every limit checked before work."""

from __future__ import annotations

import pytest

from trtopt.errors import RequestError
from trtopt.runtime.input_processor import InputLimits, InputProcessor, ProcessedPrompt
from trtopt.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(export_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(export_dir("tiny-llama"))  # SmolLM2's real tokenizer and chat template


@pytest.fixture(scope="module")
def processor(tokenizer):
    return InputProcessor(tokenizer, InputLimits(vocab_size=len(tokenizer), max_model_len=64, max_num_seqs=4,
                                                 max_prompt_bytes=1000))


def test_prompt_forms_agree(processor, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=not rendered.startswith(tokenizer.bos_token or "\0")).input_ids
    params = SamplingParams(max_tokens=4)
    forms = [messages, rendered, {"prompt": rendered}, ids, {"prompt_token_ids": ids, "prompt": rendered}]
    for form in forms:
        out = processor.process(form, params)
        assert out.prompt_token_ids == ids and out.max_tokens == 4, form
    assert processor.process(messages, params).prompt == rendered
    assert processor.process(ids, params).prompt is None
    done = processor.process("hello", params)
    assert processor.process(done, params) is done  # a ProcessedPrompt passes through


def test_max_tokens_policy(processor):
    ids = list(range(10, 30))  # 20 tokens, max_model_len 64
    assert processor.process(ids, SamplingParams(max_tokens=None)).max_tokens == 44
    assert processor.process(ids, SamplingParams(max_tokens=44)).max_tokens == 44
    with pytest.raises(RequestError, match="maximum context length is 64 tokens, but you requested 65"):
        processor.process(ids, SamplingParams(max_tokens=45))


@pytest.mark.parametrize("prompt, params, words", [
    ("x" * 1001, SamplingParams(), "1001 bytes"),
    ("é" * 501, SamplingParams(), "1002 bytes"),  # bytes, not characters
    ([{"role": "user", "content": "x" * 600}, {"role": "user", "content": "y" * 600}], SamplingParams(), "limit of 1000"),
    ("bad \ud800", SamplingParams(), "not valid Unicode"),
    ([{"role": "user", "content": "ok", "name": "\udfff"}], SamplingParams(), "messages[0].name"),
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([1, True], SamplingParams(), "list of integers"),
    ([10**9], SamplingParams(), "outside the vocabulary"),
    (list(range(64)), SamplingParams(max_tokens=None), "max_model_len is 64"),
    ("hi", SamplingParams(n=5), "max_num_seqs=4"),
    ("hi", SamplingParams(top_k=2**63), "top_k"),
    ("hi", SamplingParams(stop_token_ids=[10**9]), "stop token id"),
    ("hi", SamplingParams(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("hi", SamplingParams(prompt_logprobs=-1), "Requested prompt logprobs of 49152"),  # -1: the whole vocabulary
    (3.5, SamplingParams(), "a prompt must be"),
])
def test_refusals(processor, prompt, params, words):
    with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        processor.process(prompt, params)


def test_params_are_checked_before_tokenizing(processor):
    class Exploding(str):
        def encode(self, *a, **k):  # pragma: no cover - must never be reached
            raise AssertionError("tokenized a request whose params were already invalid")

    with pytest.raises(RequestError, match="max_num_seqs"):
        processor.process(Exploding("hi"), SamplingParams(n=10**7))


def test_processed_prompt_is_typed():
    p = ProcessedPrompt("hi", [1, 2], 3)
    with pytest.raises(AttributeError):
        p.max_tokens = 5  # frozen


def test_prompt_byte_cap_follows_the_context(tokenizer):
    from trtopt.runtime.input_processor import prompt_byte_cap

    longest = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())
    assert prompt_byte_cap(tokenizer, 64) == 64 * longest
    assert prompt_byte_cap(tokenizer, 10**6) == 1 << 20
    assert prompt_byte_cap(None, 64) == 1 << 20
    # The bound is safe: the longest prompt that fits 64 tokens is far under it.
    text = "".join(tokenizer.convert_tokens_to_string([t]) for t in sorted(tokenizer.get_vocab(), key=len)[-64:])
    assert len(text.encode("utf-8")) <= prompt_byte_cap(tokenizer, 64)
