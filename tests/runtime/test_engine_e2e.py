"""LLMEngine / LLM on a real built plan of the tiny random Llama (GQA): cheap end-to-end checks that the
runtime and the executors agree on the §3 contract (copy-on-write through the executor's copy_blocks,
stop strings on real text, errors that leave the engine healthy)."""

from __future__ import annotations

import pytest
import torch

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import SamplingParams

from stepping import assert_idle, run_all

MODEL = "tiny-llama"


def test_greedy_matches_hf_generate(engine_for, hf_model):
    engine = engine_for(MODEL, "torch", max_model_len=128)
    prompts = ["Hello, my name is", "The capital of France", "1 2 3 4 5"]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done = run_all(engine)
    for i, p in enumerate(prompts):
        x = torch.tensor([done[str(i)].prompt_token_ids])
        ref = hf_model(MODEL).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert done[str(i)].outputs[0].token_ids == ref[0, x.shape[1] :].tolist()
    assert_idle(engine)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_n2_with_seeds_equals_two_independent_runs(engine_for, backend):
    prompt = "Once upon a time there was a"  # 8 tokens: the last prompt token sits in a shared, partly filled block
    params = SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    engine = engine_for(MODEL, backend, max_model_len=128, enable_prefix_caching=False)
    engine.add_request("pair", prompt, params)
    pair = run_all(engine)["pair"]
    assert engine.kv.num_cow_copies >= 1
    assert_idle(engine)
    for i in range(2):
        solo = engine_for(MODEL, backend, max_model_len=128, enable_prefix_caching=False)
        solo.add_request("solo", prompt, SamplingParams(temperature=0.9, top_k=50, seed=7 + i, max_tokens=20, ignore_eos=True))
        assert run_all(solo)["solo"].outputs[0].token_ids == pair.outputs[i].token_ids
    assert pair.outputs[0].token_ids != pair.outputs[1].token_ids


def test_stop_string_cuts_the_text_and_streams_nothing_past_it(engine_for):
    engine = engine_for(MODEL, "torch", max_model_len=128)
    engine.add_request("free", "The capital of France", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = run_all(engine)["free"].outputs[0].text
    stop = text[10:16]  # a piece of real output, most likely spanning a token boundary
    assert text.find(stop) == 10
    engine.add_request("stopped", "The capital of France", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].delta_text
            final = out
    c = final.outputs[0]
    assert c.text == text[:10] == streamed
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert_idle(engine)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("word " * 200, SamplingParams(), "max_model_len"),
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ([1, 10**7], SamplingParams(), "vocabulary"),
        ("hi", "not params", "SamplingParams"),
        (12345, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_input_raises_and_the_engine_stays_healthy(engine_for, prompt, params, match):
    engine = engine_for(MODEL, "torch", max_model_len=128)
    engine.add_request("busy", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert set(run_all(engine)) == {"busy"}
    assert_idle(engine)


def test_invalid_sampling_values_raise_before_reaching_the_engine():
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_llm_generate_accepts_every_prompt_form(built_plan):
    from trtopt.runtime import LLM, SamplingParams as SP

    llm = LLM(built_plan(MODEL), max_model_len=128)
    ids = llm.get_tokenizer()("Hello there").input_ids
    streamed = []
    outs = llm.generate(
        ["Hello there", [{"role": "user", "content": "Hi!"}], {"prompt_token_ids": ids}],
        SP(temperature=0, max_tokens=6, ignore_eos=True),
        on_output=streamed.append,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # same tokens, same output
    assert outs[1].prompt.startswith("<|im_start|>")  # the chat template was applied
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].metrics.time_to_first_token > 0
    assert outs[0].metrics.decode_tokens_per_s(6) > 0
    assert len(streamed) >= 6
    with pytest.raises(RequestError):
        llm.generate(["ok", ""], SP(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()  # the valid half of a bad batch was withdrawn


def test_llm_generate_use_tqdm_shows_progress_with_token_rates(built_plan, capsys):
    from trtopt.runtime import LLM, SamplingParams as SP

    llm = LLM(built_plan(MODEL), max_model_len=128)
    params = SP(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate(["Hello there", "Once upon a time"], params)
    shown = llm.generate(["Hello there", "Once upon a time"], params, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in plain]
    out = capsys.readouterr().out
    assert "Processed prompts" in out and "2/2" in out and "output" in out and "tok/s" in out


def test_llm_generate_without_a_callback_makes_only_final_outputs(built_plan):
    """No on_output: LLM.generate runs its requests with output_kind=FINAL_ONLY (the engine builds one output per
    request), and returns what the streamed run returns; the caller's params are not changed."""
    from trtopt.runtime import LLM, RequestOutputKind, SamplingParams as SP

    llm = LLM(built_plan(MODEL), max_model_len=128)
    params = SP(temperature=0, max_tokens=6, ignore_eos=True)
    streamed = []
    with_callback = llm.generate(["Hello there", "Once upon a time"], params, on_output=streamed.append)
    made = []
    step = llm.engine.step
    llm.engine.step = lambda: made.extend(outs := step()) or outs
    plain = llm.generate(["Hello there", "Once upon a time"], params)
    assert len(streamed) > 2 and len(made) == 2 and all(o.finished for o in made)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in plain] == \
        [(o.outputs[0].token_ids, o.outputs[0].text) for o in with_callback]
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_tokenize_is_public_and_sees_prompts_as_add_request_does(engine_for):
    """LLMEngine.tokenize is public API (scripts call it): every prompt form gives the ids the request is run with."""
    engine = engine_for(MODEL, "torch", max_model_len=128)
    chat = [{"role": "user", "content": "Hi!"}]
    for i, prompt in enumerate(["Hello there", chat, {"prompt_token_ids": [5, 6, 7]}, [9, 10]]):
        text, ids = engine.tokenize(prompt)
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        assert run_all(engine)[str(i)].prompt_token_ids == ids
        assert (text is None) == (not isinstance(prompt, str) and prompt is not chat)
    assert engine.tokenize(chat)[0].startswith("<|im_start|>")
    with pytest.raises(RequestError):
        engine.tokenize(3.5)
