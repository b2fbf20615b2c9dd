"""vLLM's per-request logits controls and prompt_logprobs, end to end on built plans.

prompt_logprobs, bad_words and truncate_prompt_tokens run on the real SmolLM2 (their meaning depends on a real
tokenizer and real logits); the masks, biases and logits processors on the tiny random Llama, mixed in one batch
with requests that have none, whose tokens must not change.
"""

from __future__ import annotations

import pytest
import torch

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import SamplingParams

from stepping import run_all

TINY = "tiny-llama"
SMOL = "smollm2-135m"


def run(engine, requests: dict):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return run_all(engine)


def tokens(out, i=0):
    return out.outputs[i].token_ids


# ---- prompt_logprobs -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prompt_logprobs_equal_hf_log_softmax_through_chunks_and_a_warm_prefix_cache(smollm2_engine, hf_model):
    """Chunks of 16 tokens split the prompt across steps; the same prompt already sits in the prefix cache, which
    a prompt_logprobs request must not use (a cached prefix has no logits); n=2 reports them once."""
    prompt = ("The history of the city begins in the Roman era, when a small fort guarded the river crossing. "
              "Over the centuries it grew into a market town")
    engine = smollm2_engine(max_num_batched_tokens=16)
    run(engine, {"warm": (prompt, SamplingParams(temperature=0, max_tokens=2))})  # fills the prefix cache
    done = run(engine, {
        "plp": (prompt, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=3, prompt_logprobs=3)),
        "other": ("Hello there", SamplingParams(temperature=0, max_tokens=4)),
    })
    out = done["plp"]
    ids = out.prompt_token_ids
    assert len(ids) > 2 * 16 - 4 and out.num_cached_tokens == 0  # two chunks; a full block was cached
    assert done["other"].prompt_logprobs is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(SMOL)(torch.tensor([ids])).logits[0].float(), -1)
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for j in range(1, len(ids)):
        row = lps[j]
        assert ids[j] in row and len(row) in (3, 4)
        for t, v in row.items():
            assert abs(v - ref[j - 1, t].item()) < 1e-4, (j, t, v, ref[j - 1, t].item())
        assert set(ref[j - 1].topk(3).indices.tolist()) <= set(row)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])  # async: ids filled on the host (ORT)
def test_prompt_logprobs_of_a_token_prompt_on_the_tiny_model(engine_for, hf_model, async_scheduling):
    engine = engine_for(TINY, "onnxruntime", max_model_len=128, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    assert engine.async_scheduling is async_scheduling
    ids = [5, 17, 99, 3, 250, 41, 7, 7, 7, 12, 60]
    out = run(engine, {"a": ({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))})["a"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(TINY)(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        assert list(out.prompt_logprobs[j]) == [ids[j]]
        assert abs(out.prompt_logprobs[j][ids[j]] - ref[j - 1, ids[j]].item()) < 1e-4


# ---- masks, biases, processors on the tiny model -------------------------------------------------------------


def test_controls_hold_and_leave_the_other_rows_of_the_batch_alone(engine_for):
    prompt = "Once upon a time there was a"
    free_greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free_seeded = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=12, ignore_eos=True)
    alone = run(engine_for(TINY, "torch", max_model_len=128),
                {"g": (prompt, free_greedy), "s": (prompt, free_seeded)})
    allowed = (101, 202, 303)
    forced = 77
    seen_calls = []

    def processor(output_ids, logits):  # bans whatever the greedy row would pick next: a real change
        seen_calls.append(len(output_ids))
        logits[int(logits.argmax())] = float("-inf")
        return logits

    mixed = run(engine_for(TINY, "torch", max_model_len=128), {
        "g": (prompt, free_greedy),
        "allowed": (prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)),
        "bias": (prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True, logit_bias={forced: 100})),
        "ban": (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={t: -100 for t in tokens(alone["g"])})),
        "proc": (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logits_processors=[processor])),
        "s": (prompt, free_seeded),
    })
    assert tokens(mixed["g"]) == tokens(alone["g"]) and tokens(mixed["s"]) == tokens(alone["s"])
    assert set(tokens(mixed["allowed"])) <= set(allowed)
    assert tokens(mixed["bias"]) == [forced] * 12
    assert not set(tokens(mixed["ban"])) & set(tokens(alone["g"]))
    assert tokens(mixed["proc"])[0] != tokens(alone["g"])[0] and seen_calls[:3] == [0, 1, 2]


def test_three_argument_processor_sees_the_prompt(engine_for):
    engine = engine_for(TINY, "torch", max_model_len=128)
    prompts = []

    def processor(prompt_ids, output_ids, logits):
        prompts.append(list(prompt_ids))
        return logits

    out = run(engine, {"p": ({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=2, logits_processors=[processor]))})
    assert prompts == [[4, 5, 6], [4, 5, 6]] and len(tokens(out["p"])) == 2


def test_a_broken_processor_fails_only_its_request(engine_for):
    engine = engine_for(TINY, "torch", max_model_len=128)
    done = run(engine, {
        "bad": ("Hello", SamplingParams(temperature=0, max_tokens=3, logits_processors=[lambda ids, logits: None])),
        "ok": ("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
    })
    assert done["bad"].outputs[0].finish_reason == "error" and "logits processor" in done["bad"].error
    assert len(tokens(done["ok"])) == 3


@pytest.mark.parametrize("kwargs, field", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),  # -1 is the whole vocabulary; the cap is the engine's
    ({"logits_processors": [lambda logits: logits]}, "logits_processors"),
    ({"logits_processors": ["not callable"]}, "logits_processors"),
])
def test_bad_values_are_request_errors(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_request_errors(engine_for):
    engine = engine_for(TINY, "torch", max_model_len=128)
    vocab = engine.plan.model.vocab_size
    for params in (SamplingParams(allowed_token_ids=[1, vocab]), SamplingParams(logit_bias={vocab: 1.0})):
        with pytest.raises(RequestError, match="outside the vocabulary"):
            engine.add_request("x", "Hello", params)
    assert not engine.has_unfinished_requests()


# ---- bad_words and truncate_prompt_tokens on SmolLM2 -------------------------------------------------------------


@pytest.mark.slow
def test_bad_words_are_never_produced(smollm2_engine):
    """Ban the first two words of the greedy answer as one phrase, and its third word alone: the greedy run must
    change where the phrase would complete, and no run (greedy or sampled) may contain either token sequence."""
    engine = smollm2_engine()
    prompt = "The capital of France is"
    free = run(engine, {"f": (prompt, SamplingParams(temperature=0, max_tokens=8))})["f"]
    words = free.outputs[0].text.split()
    assert len(words) >= 3, free.outputs[0].text
    bad = [" ".join(words[:2]), words[2]]
    banned = engine.input_processor.bad_words_token_ids(SamplingParams(bad_words=bad))
    assert any(len(seq) > 1 for seq in banned)
    done = run(engine, {
        "greedy": (prompt, SamplingParams(temperature=0, max_tokens=8, bad_words=bad)),
        **{f"s{i}": (prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=16, bad_words=bad)) for i in range(4)},
    })
    assert tokens(done["greedy"]) != tokens(free)
    for out in done.values():
        ids = tokens(out)
        for seq in banned:
            n = len(seq)
            assert all(tuple(ids[i : i + n]) != seq for i in range(len(ids) - n + 1)), (engine.tokenizer.decode(ids), seq)


@pytest.mark.slow
def test_truncate_prompt_tokens_equals_running_the_truncated_prompt(smollm2_engine):
    engine = smollm2_engine()
    prompt = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    ids = engine.input_processor.tokenize(prompt)[1]
    done = run(engine, {
        "cut": (prompt, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=5)),
        "ref": ({"prompt_token_ids": ids[-5:]}, SamplingParams(temperature=0, max_tokens=8)),
        "long": (prompt, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=1000)),
    })
    assert done["cut"].prompt_token_ids == ids[-5:]
    assert tokens(done["cut"]) == tokens(done["ref"])
    assert done["cut"].prompt == engine.tokenizer.decode(ids[-5:])
    assert done["long"].prompt_token_ids == ids and done["long"].prompt == prompt
