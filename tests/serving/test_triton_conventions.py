"""Clients written for the TensorRT-LLM backend and for the vLLM backend, unchanged, against `trtopt triton-repo` on
the real tritonserver with the real SmolLM2: greedy text equals LLM.generate on the same plan.

- TensorRT-LLM: tritonclient.grpc streaming to the "ensemble" model with batched [1, 1] inputs, as
  tensorrtllm_backend's inflight_batcher_llm/client/end_to_end_grpc_client.py builds them (text_input, max_tokens,
  stream, beam_width, temperature, num_return_sequences, bad_words, stop_words, end_id, pad_id,
  exclude_input_in_output, return_log_probs), reading `text_output[0].decode()`; and the HTTP generate endpoint with
  the JSON of the TensorRT-LLM README's curl example.
- vLLM: tritonclient.grpc to the model with [1] inputs, as vllm_backend's samples/client.py builds them (text_input,
  stream, sampling_parameters JSON with string numbers, exclude_input_in_output); and HTTP generate_stream.

tritonclient.http cannot reach a decoupled model (Triton's /infer refuses them), so HTTP goes through the generate
extension, as users of both backends do. One tritonserver serves the whole module (it is slow to start).
"""

from __future__ import annotations

import json
import queue

import httpx
import numpy as np
import pytest
from live_server import running_tritonserver

from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.triton_repo import TritonRepoConfig, write_triton_repo

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ENSEMBLE = "ensemble"
PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def plan(built_plan):
    return built_plan("smollm2-135m")


@pytest.fixture(scope="module")
def reference(plan):
    """LLM.generate's greedy answers on the same plan: {prompt: RequestOutput}, logprobs of the chosen tokens."""
    from trtopt.runtime.llm import LLM

    with LLM(plan, num_blocks=160) as llm:
        chat = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                       tokenize=False, add_generation_prompt=True)
        prompts = [PROMPT, chat]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))
    return dict(zip(prompts, outs))


@pytest.fixture(scope="module")
def triton(plan, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton-smol") / "repo"
    write_triton_repo(plan, repo, TritonRepoConfig(name=MODEL, num_blocks=160, max_batch=8))
    with running_tritonserver(repo, tmp_path_factory.mktemp("tritonserver-smol"), MODEL) as addresses:
        yield addresses


def _grpc(address: str, model: str, inputs: dict[str, np.ndarray]) -> list:
    """One streamed gRPC request (tritonclient's start_stream/async_stream_infer): its responses, up to the final one."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        responses = []
        for _ in range(MAX_TOKENS + 4):
            result, error = results.get(timeout=120)
            if error is not None:
                return [error]
            if result.get_response().outputs:
                responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
        raise AssertionError("no final response")
    finally:
        client.stop_stream()
        client.close()


def _trtllm_inputs(prompt: str, *, streaming: bool, **extra) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client.py's prepare_inputs (batch dimension first)."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * MAX_TOKENS,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "bad_words": np.array([[""]], dtype=object),
        "stop_words": np.array([[""]], dtype=object),
        "end_id": np.array([[2]], dtype=np.int32),
        "pad_id": np.array([[2]], dtype=np.int32),
    }
    return inputs | extra


def _vllm_inputs(prompt: str, *, stream: bool, sampling_parameters: dict, exclude_input_in_output: bool | None = None):
    """vllm_backend samples/client.py's create_request."""
    inputs = {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "stream": np.array([stream], dtype=bool),
        "sampling_parameters": np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_),
    }
    if exclude_input_in_output is not None:
        inputs["exclude_input_in_output"] = np.array([exclude_input_in_output], dtype=bool)
    return inputs


def test_tensorrt_llm_grpc_client_streaming_and_not(triton, reference):
    _, grpc_address = triton
    for prompt, ref in reference.items():
        expected = ref.outputs[0].text
        pieces = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs(prompt, streaming=True))
        assert "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in pieces) == expected
        assert pieces[-1].as_numpy("finish_reason")[0].decode() == ref.outputs[0].finish_reason
        [whole] = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs(prompt, streaming=False))
        assert whole.as_numpy("text_output")[0].decode("utf-8") == prompt + expected  # exclude_input_in_output unset
        [excluded] = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs(
            prompt, streaming=False, exclude_input_in_output=np.array([[True]]),
            return_log_probs=np.array([[True]])))
        assert excluded.as_numpy("text_output")[0].decode("utf-8") == expected
        log_probs = excluded.as_numpy("output_log_probs")
        chosen = [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
        assert log_probs.shape == (1, 1, len(chosen))  # [batch, beam, tokens], as TensorRT-LLM shapes it
        np.testing.assert_allclose(log_probs[0, 0], chosen, atol=1e-4)
        np.testing.assert_allclose(excluded.as_numpy("cum_log_probs")[0, 0], sum(chosen), atol=1e-3)
        assert excluded.as_numpy("num_input_tokens")[0, 0] == len(ref.prompt_token_ids)
        assert excluded.as_numpy("num_output_tokens")[0, 0] == len(ref.outputs[0].token_ids)
    # bad_words: the greedy answer's first word can no longer be generated.
    banned = reference[PROMPT].outputs[0].text.split()[0].strip(".,")
    [whole] = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs(PROMPT, streaming=False, bad_words=np.array([[banned]], dtype=object),
                                                           exclude_input_in_output=np.array([[True]])))
    text = whole.as_numpy("text_output")[0].decode("utf-8")
    assert text and banned not in text, (banned, text)


def test_vllm_grpc_client_streaming_and_not(triton, reference):
    _, grpc_address = triton
    params = {"temperature": "0", "max_tokens": str(MAX_TOKENS)}  # string numbers, as vLLM's sample sends them
    for prompt, ref in reference.items():
        expected = ref.outputs[0].text
        pieces = _grpc(grpc_address, MODEL, _vllm_inputs(prompt, stream=True, sampling_parameters=params))
        assert "".join(t.decode("utf-8") for r in pieces for t in r.as_numpy("text_output")) == expected
        [whole] = _grpc(grpc_address, MODEL, _vllm_inputs(prompt, stream=False, sampling_parameters=params))
        assert whole.as_numpy("text_output")[0].decode("utf-8") == prompt + expected
        [excluded] = _grpc(grpc_address, MODEL, _vllm_inputs(prompt, stream=False, sampling_parameters=params,
                                                             exclude_input_in_output=True))
        assert excluded.as_numpy("text_output")[0].decode("utf-8") == expected
        assert excluded.as_numpy("finish_reason")[0].decode() == ref.outputs[0].finish_reason


def test_http_generate_with_both_conventions(triton, reference):
    base, _ = triton
    ref = reference[PROMPT].outputs[0]
    # The TensorRT-LLM README's curl body, to the ensemble.
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": "", "temperature": 0.0}
    resp = httpx.post(f"{base}/v2/models/{ENSEMBLE}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["text_output"] == PROMPT + ref.text
    # vLLM's sampling_parameters, streamed over SSE from the model itself.
    body = {"text_input": PROMPT, "stream": True, "return_num_output_tokens": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})}
    with httpx.stream("POST", f"{base}/v2/models/{MODEL}/generate_stream", json=body, timeout=120) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == ref.text
    assert sum(e["num_output_tokens"] for e in events) == len(ref.token_ids)
    assert events[-1]["finish_reason"] == ref.finish_reason
    # n completions: one row each (the vLLM backend's shape).
    body = {"text_input": PROMPT, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS, "n": 2})}
    resp = httpx.post(f"{base}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["text_output"] == [ref.text, ref.text]


def test_bad_values_get_a_triton_error_and_the_model_keeps_serving(triton, reference):
    base, grpc_address = triton
    resp = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=60,
                      json={"text_input": "hi", "sampling_parameters": '{"temperature": "hot"}'})
    assert resp.status_code == 400 and "temperature='hot' is invalid" in resp.json()["error"], resp.text
    [error] = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs("hi", streaming=True, beam_width=np.array([[4]], dtype=np.int32)))
    assert "beam_width=4" in str(error)
    [error] = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs("hi", streaming=False, top_p=np.array([[0.0]], dtype=np.float32)))
    assert "top_p" in str(error)
    batch_of_two = {name: np.repeat(value, 2, axis=0) for name, value in _trtllm_inputs("hi", streaming=False).items()}
    [error] = _grpc(grpc_address, ENSEMBLE, batch_of_two)
    assert "batch size 2" in str(error)
    pieces = _grpc(grpc_address, ENSEMBLE, _trtllm_inputs(PROMPT, streaming=True))
    assert "".join(r.as_numpy("text_output")[0].decode() for r in pieces) == reference[PROMPT].outputs[0].text
