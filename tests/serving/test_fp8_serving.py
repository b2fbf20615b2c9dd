"""A plan built with `--kv-cache-dtype fp8` served the two ways trtopt serves (issue 33's "the server and the
Triton repository"): `trtopt serve` queried with the official openai client, and `trtopt triton-repo` under the real
tritonserver. Greedy answers equal LLM.generate's on the same FP8 plan, and /metrics names the pools' dtype."""

from __future__ import annotations

import httpx
import pytest
from live_server import API_KEY, running_tritonserver, start_server

from trtopt.runtime.sampling_params import SamplingParams

MODEL = "tiny_fp8"
PROMPTS = ["The capital of France is", "One, two, three,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fp8_plan(export_dir, tmp_path_factory):
    from trtopt.builder.pipeline import build_plan

    out = tmp_path_factory.mktemp("serving-fp8") / "plan"
    build_plan(export_dir("tiny-llama"), out, progress=False, kv_cache_dtype="fp8")
    return out


@pytest.fixture(scope="module")
def reference(fp8_plan):
    """LLM.generate's greedy completions on the FP8 plan, by prompt."""
    from trtopt.runtime.llm import LLM

    with LLM(fp8_plan, num_blocks=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def test_openai_server_serves_an_fp8_plan(fp8_plan, reference, tmp_path):
    import openai

    server = start_server(fp8_plan, tmp_path / "serve.log", "--api-key", API_KEY, "--num-blocks", "64")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        for prompt in PROMPTS:
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert done.choices[0].text == reference[prompt]
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert 'trtopt_kv_cache_dtype_info{dtype="float8_e4m3fn"} 1.0' in text
        assert server.wait_idle()["trtopt_num_requests_running"] == 0
    finally:
        server.stop()


def test_triton_repository_serves_an_fp8_plan(fp8_plan, reference, tmp_path):
    from trtopt.serving.triton_repo import TritonRepoConfig, write_triton_repo

    repo = tmp_path / "repo"
    write_triton_repo(fp8_plan, repo, TritonRepoConfig(name=MODEL, num_blocks=64, max_batch=4))
    with running_tritonserver(repo, tmp_path / "tritonserver", MODEL) as (base, _):
        for prompt in PROMPTS:
            resp = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=120,
                              json={"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                    "ignore_eos": True, "exclude_input_in_output": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["text_output"] == reference[prompt]
