"""The Triton request translation (trtopt.serving.triton_request) and the repository's checks against the plan,
without a tritonserver: the live conventions are in test_triton_conventions.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from trtopt.builder.plan import read_plan
from trtopt.errors import ConfigError, RequestError
from trtopt.runtime.sampling_params import StructuredOutputsParams
from trtopt.serving.triton_repo import TritonRepoConfig, write_triton_repo
from trtopt.serving.triton_request import INPUTS, OUTPUTS, parse_request

EOS = (2,)


def _tensors(**inputs) -> dict[str, np.ndarray]:
    """Inputs as Triton hands them to the model (max_batch_size 0: no batch dimension)."""
    out = {}
    for name, value in inputs.items():
        spec = next(t for t in INPUTS if t.name == name)
        dtype = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
                 "TYPE_BOOL": np.bool_}[spec.triton_type]
        values = value if isinstance(value, list) else [value]
        out[name] = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=dtype)
    return out


def parse(**inputs):
    tensors = _tensors(**inputs)
    return parse_request(tensors.get, EOS)


def test_tensorrt_llm_names_map_onto_sampling_params():
    r = parse(text_input="Hi", max_tokens=12, top_k=5, top_p=0.5, temperature=0.7, repetition_penalty=1.1,
              presence_penalty=0.25, frequency_penalty=-0.5, min_tokens=2, seed=7, stop_words=["\n", ""],
              num_return_sequences=2, beam_width=1, pad_id=0, stream=True)
    p = r.params
    assert (r.prompt, r.stream, r.include_prompt) == ("Hi", True, False)
    assert (p.max_tokens, p.top_k, p.top_p, p.temperature, p.n, p.seed, p.min_tokens) == (12, 5, 0.5, pytest.approx(0.7), 2, 7, 2)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (pytest.approx(1.1), 0.25, -0.5)
    assert p.stop == ("\n",)  # TensorRT-LLM clients send "" for "none"
    assert p.logprobs is None and not r.trtllm_log_probs


def test_defaults_follow_both_backends():
    r = parse(text_input="Hi")
    assert r.params.max_tokens == 16 and not r.stream
    assert r.include_prompt  # non-streaming text_output starts with the prompt (TensorRT-LLM and vLLM backends)
    assert not parse(text_input="Hi", exclude_input_in_output=True).include_prompt


def test_end_id_replaces_eos_and_the_model_eos_changes_nothing():
    other = parse(text_input="Hi", end_id=13).params
    assert other.ignore_eos and other.stop_token_ids == (13,)
    same = parse(text_input="Hi", end_id=2).params
    assert not same.ignore_eos and same.stop_token_ids == ()


def test_log_probs_flags_ask_the_engine_for_the_chosen_token_only():
    assert parse(text_input="Hi", return_log_probs=True).params.logprobs == 0
    r = parse(text_input="Hi", return_cumulative_logprob=True)
    assert r.params.logprobs == 0 and r.vllm_cumulative_logprob and not r.vllm_logprobs


@pytest.mark.parametrize(("kind", "guide", "expected"), [
    ("json", None, StructuredOutputsParams(json_object=True)),
    ("json_schema", '{"type": "object"}', StructuredOutputsParams(json='{"type": "object"}')),
    ("regex", "[0-9]+", StructuredOutputsParams(regex="[0-9]+")),
    ("ebnf_grammar", 'root ::= "a"', StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_guided_decoding_maps_onto_structured_outputs(kind, guide, expected):
    inputs = {"guided_decoding_guide_type": kind} | ({"guided_decoding_guide": guide} if guide else {})
    assert parse(text_input="Hi", **inputs).params.structured_outputs == expected


def test_vllm_sampling_parameters_with_string_numbers():
    """The vLLM backend's samples send numbers as JSON strings ({"temperature": "0.1"}); it converts them."""
    body = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "20", "n": 2, "stop": ["!"], "ignore_eos": "true",
            "structured_outputs": json.dumps({"choice": ["yes", "no"]})}
    r = parse(text_input="Hi", sampling_parameters=json.dumps(body), stream=True, return_logprobs=True)
    p = r.params
    assert (p.temperature, p.top_p, p.max_tokens, p.n, p.stop, p.ignore_eos) == (0.1, 0.95, 20, 2, ("!",), True)
    assert p.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))
    assert r.vllm_logprobs and p.logprobs == 0


@pytest.mark.parametrize(("inputs", "says"), [
    ({}, "text_input is required"),
    ({"text_input": "Hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "Hi", "top_p": 0.0}, "top_p"),
    ({"text_input": "Hi", "beam_width": 4}, "beam_width"),
    ({"text_input": "Hi", "end_id": -1}, "end_id"),
    ({"text_input": "Hi", "max_tokens": [1, 2]}, "exactly one value"),
    ({"text_input": "Hi", "guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "x"}, "structural_tag"),
    ({"text_input": "Hi", "guided_decoding_guide_type": "regex"}, "guided_decoding_guide"),
    ({"text_input": "Hi", "guided_decoding_guide": "[0-9]"}, "guided_decoding_guide_type"),
    ({"text_input": "Hi", "sampling_parameters": "{not json"}, "not valid JSON"),
    ({"text_input": "Hi", "sampling_parameters": "[1]"}, "JSON object"),
    ({"text_input": "Hi", "sampling_parameters": '{"temprature": 0}'}, "unknown key 'temprature'"),
    ({"text_input": "Hi", "sampling_parameters": '{"temperature": "hot"}'}, "temperature='hot' is invalid: send a number"),
    ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": 1.5}'}, "send an integer"),
    ({"text_input": "Hi", "sampling_parameters": '{"ignore_eos": "maybe"}'}, "true or false"),
    ({"text_input": "Hi", "sampling_parameters": '{"lora_name": "x"}'}, "LoRA"),
    ({"text_input": "Hi", "sampling_parameters": '{"prompt_logprobs": 1}'}, "no prompt log-prob output"),
    ({"text_input": "Hi", "sampling_parameters": '{"logits_processors": []}'}, "callables"),
    ({"text_input": "Hi", "sampling_parameters": '{"logit_bias": {"x": 1}}'}, "not a token id"),
    ({"text_input": "Hi", "sampling_parameters": '{"logit_bias": {"3": 500}}'}, "logit_bias"),
    ({"text_input": "Hi", "max_tokens": 4, "sampling_parameters": '{"max_tokens": 8}'}, "both"),
    ({"text_input": "Hi", "sampling_parameters": '{"structured_outputs": {"regex": "a", "choice": ["b"]}}'}, "exactly one"),
])
def test_bad_values_are_request_errors_naming_the_input(inputs, says):
    with pytest.raises(RequestError) as e:
        parse(**inputs)
    assert says in str(e.value)


def test_invalid_utf8_is_a_request_error():
    with pytest.raises(RequestError, match="UTF-8"):
        parse_request({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}.get, EOS)


def test_bad_words_and_vllm_token_controls_reach_sampling_params():
    assert parse(text_input="Hi", bad_words=["foo", ""]).params.bad_words == ("foo",)
    assert parse(text_input="Hi", bad_words=[""]).params.bad_words == ()  # TensorRT-LLM's "none"
    body = {"logit_bias": {"17": -100, "4": 2.5}, "allowed_token_ids": [1, 2, 3], "bad_words": ["x"]}
    p = parse(text_input="Hi", sampling_parameters=json.dumps(body)).params
    assert p.logit_bias == {17: -100, 4: 2.5} and p.allowed_token_ids == (1, 2, 3) and p.bad_words == ("x",)


def test_config_declares_every_input_optional_but_text_input(tiny_plan, tmp_path):
    write_triton_repo(tiny_plan, tmp_path, TritonRepoConfig(name="m"))
    for model in ("m", "ensemble"):
        config = (tmp_path / model / "config.pbtxt").read_text()
        for spec in INPUTS:
            line = next(line for line in config.splitlines() if f'name: "{spec.name}"' in line)
            assert ("optional: true" in line) == (spec.name != "text_input"), line
        assert all(f'name: "{spec.name}"' in config for spec in OUTPUTS)
    assert "max_batch_size: 0" in (tmp_path / "m" / "config.pbtxt").read_text()
    plan_batch = read_plan(tiny_plan).limits.max_num_seqs  # the ensemble's default max_batch_size
    assert f"max_batch_size: {plan_batch}\n" in (tmp_path / "ensemble" / "config.pbtxt").read_text()


def test_speculative_config_passes_through_to_the_model_parameters(tiny_plan, tmp_path):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    write_triton_repo(tiny_plan, tmp_path, TritonRepoConfig(speculative_config=spec, max_batch=2, instances=1))
    config = (tmp_path / "trtopt" / "config.pbtxt").read_text()
    line = next(line for line in config.splitlines() if 'key: "speculative_config"' in line)
    assert '\\"method\\": \\"ngram\\"' in line and '\\"num_speculative_tokens\\": 3' in line, line
    assert 'key: "max_num_seqs" value: { string_value: "2" }' in config


@pytest.mark.parametrize(("config", "says"), [
    (TritonRepoConfig(max_batch=10_000), "exceeds the plan's max_num_seqs"),
    (TritonRepoConfig(max_batch_tokens=10**6), "exceeds the plan's max_num_tokens"),
    (TritonRepoConfig(num_blocks=2), "cannot hold one sequence"),
    (TritonRepoConfig(speculative_config="{oops"), "not valid JSON"),
    (TritonRepoConfig(speculative_config='{"method": "medusa", "num_speculative_tokens": 2}'), "unknown"),
    (TritonRepoConfig(instances=10_000), "CPU instances exceed"),
    (TritonRepoConfig(backend="vllm"), "--backend"),
    (TritonRepoConfig(ensemble_name="trtopt"), "must differ"),
])
def test_a_repository_that_could_not_load_is_refused_before_writing(tiny_plan, tmp_path, config, says):
    with pytest.raises(ConfigError) as e:
        write_triton_repo(tiny_plan, tmp_path / "repo", config)
    assert says in str(e.value)
    assert not (tmp_path / "repo").exists()


def test_a_plan_without_tokenizer_is_refused(tiny_plan, tmp_path):
    plan = tmp_path / "plan"
    shutil.copytree(tiny_plan, plan, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special_tokens*"))
    with pytest.raises(ConfigError, match="no tokenizer files"):
        write_triton_repo(plan, tmp_path / "repo")
