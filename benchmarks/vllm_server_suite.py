"""vLLM's own OpenAI-server tests, run against `trtopt serve` with only vLLM's server launcher replaced.

The test files come from a vLLM checkout or bare git mirror at run time and go to a scratch folder (default
/tmp/vllm_suite); nothing of vLLM is kept in this repository. Beside them the script writes:

- tests/utils.py: a `RemoteOpenAIServer` that starts `trtopt serve PLAN --model-name NAME ...` (the test's model name,
  served by the plan's model) and maps the vLLM flags the tests pass to trtopt's; flags trtopt has no use for
  (--dtype, --enforce-eager's GPU meaning, LoRA, ...) are dropped and printed;
- tests/conftest.py: no network (huggingface_hub.snapshot_download answers a dummy folder), LoRA-model parameters
  skipped as not applicable;
- shim/vllm/: `vllm` with the few names tests use against the server (get_tokenizer = the plan's tokenizer,
  ModelConfig.get_vocab_size, get_open_port, current_platform); any other vllm name is a stub that skips the test
  using it ("N/A: vLLM internal ..."), since those are unit tests of vLLM's own classes.

Then it runs pytest once per file (a `timeout` per file, pytest-timeout per test), reads the JUnit XML and writes
counts per file plus one classified line per failure. Usage:

    .venv/bin/python benchmarks/vllm_server_suite.py --vllm /path/to/vllm(.git) --plan /tmp/vs/plan \
        --out docs/benchmarks/vllm_server_suite.json [--files tests/entrypoints/openai/test_x.py ...]

pytest-asyncio is needed (the trtopt venv lacks it): `pip install --target /tmp/vllm_suite/site pytest-asyncio`;
the script puts /tmp/vllm_suite/site on PYTHONPATH. Causes come from `CAUSES` (a note per test id, filled in after
reading the failures of a run) and otherwise from the error text (`_auto_cause`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# Black-box files: each starts a server and talks HTTP to it (plus the unit tests inside them, skipped by the shim).
FILES = [
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/openai/chat_completion/test_chat_with_tool_reasoning.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py",
    "tests/entrypoints/openai/chat_completion/test_root_path.py",
    "tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/test_return_tokens_as_ids.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_async_tokenization.py",
    "tests/entrypoints/openai/models/test_models.py",
    "tests/entrypoints/serve/instrumentator/test_basic.py",
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    "tests/entrypoints/serve/instrumentator/test_optional_middleware.py",
    "tests/entrypoints/serve/instrumentator/test_orca_metrics.py",
    "tests/entrypoints/serve/instrumentator/test_sleep.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/tool_use/test_chat_completions.py",
    "tests/tool_use/test_tool_calls.py",
    "tests/tool_use/test_parallel_tool_calls.py",
    "tests/tool_use/test_tool_choice_required.py",
]
# Copied as they are: fixtures and helpers the files above import.
SUPPORT = [
    "tests/entrypoints/conftest.py",
    "tests/tool_use/conftest.py",
    "tests/tool_use/utils.py",
]

CAUSE_KINDS = ("model text", "trtopt bug", "missing feature", "not applicable")
# test id (file::name[param]) or a prefix of it -> (kind, one line). Filled in from reading a run's failures.
_CHAT = "tests/entrypoints/openai/chat_completion/test_chat.py::"
_FC = "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py::"
_ROOT = "tests/entrypoints/openai/chat_completion/test_root_path.py::"
_MIDDLE = "tests/entrypoints/serve/instrumentator/test_optional_middleware.py::"
CAUSES: dict[str, tuple[str, str]] = {
    _CHAT + "test_invocations": (
        "not applicable", "the installed openai client's ChatCompletion.model_dump() adds 'moderation' and "
                          "'metadata' keys that no server's JSON has (vLLM's neither); the rest of the keys match"),
    _CHAT + "test_more_than_one_prompt_logprobs_chat": (
        "model text", "prompt_logprobs=1 gives 2 entries where the prompt token is not SmolLM2's top-1 (vLLM's rule "
                      "too); the test assumes zephyr ranks it first"),
    _CHAT + "test_single_chat_session": ("model text", "usage prompt_tokens=37 is zephyr's chat template length"),
    _CHAT + "test_structured_outputs_choice_chat": (
        "model text", "two samples at temperature 0.7 picked the same choice (test wants them to differ)"),
    _CHAT + "test_response_format_json_object": (
        "model text", "SmolLM2's JSON object to 'what is 1+1' is not {'result': 2} (valid JSON, wrong answer)"),
    _CHAT + "test_response_format_json_schema": (
        "model text", "SmolLM2 answers {'result': 1} under the schema (valid, wrong sum); on a slower run it timed "
                      "out (no max_tokens: up to 2048 tokens on CPU)"),
    _CHAT + "test_custom_role": (
        "not applicable", "CPU run: no max_tokens, so two greedy replies run to the 2048-token context, past the "
                          "150 s limit (300 s too, run 6; the custom role is accepted; the test passes with "
                          "--per-test-s 900)"),
    _CHAT + "test_structured_outputs_json_chat": (
        "model text", "sampled (temperature 1, no seed) SmolLM2 kept the JSON open to max_completion_tokens=1000: "
                      "finish_reason 'length', the text cut inside a string (seed 2 does so in-process, seeds 0 and "
                      "1 give schema-valid JSON); vLLM does not close a grammar at max_tokens either"),
    _CHAT + "test_complex_message_content": ("model text", "SmolLM2 answers '1 + 1 = 2', the test wants '2'"),
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_"
    "message[test_case0]": ("not applicable", "CPU run: continue_final_message without max_tokens ran past 150 s"),
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py::test_prompt_logprobs": (
        "not applicable", "CPU run: prompt_logprobs=-1 is served now (--max-logprobs), but the request has no "
                          "max_tokens: up to ~2000 tokens on CPU, past the 150 s limit"),
    "tests/entrypoints/openai/chat_completion/test_chat_with_tool_reasoning.py::test_chat_": (
        "model text", "SmolLM2 writes no </think> and no <tool_call>: under deepseek_r1 the whole reply is "
                      "reasoning (non-empty now), so there is no tool call to find"),
    _FC + "test_function_tool_use[True-auto-True": (
        "model text", "tool_choice auto, streamed: SmolLM2 writes no hermes <tool_call>, so no tool-call deltas"),
    _FC + "test_function_tool_use[True-auto-False": (
        "model text", "SmolLM2 writes no <think> (reasoning None) and no hermes <tool_call>"),
    _FC + "test_function_tool_use[True-required-True": (
        "model text", "streamed 'required' under qwen3 reasoning: SmolLM2 either opened <think> and did not close it "
                      "within the context (no grammar, no call) or began with the call (no reasoning); the "
                      "reasoning-gated grammar allows both first tokens"),
    _FC + "test_function_tool_use[True-required-False": (
        "model text", "SmolLM2 opens <think> and never closes it, so the grammar never starts; the test sets no "
                      "max_tokens and times out on CPU"),
    _FC + "test_function_tool_use[True-tool_choice2": (
        "model text", "sampled: SmolLM2 either began with the named call instead of <think> (the call, no "
                      "reasoning: run 5) or opened <think> and ended with EOS inside it (reasoning only, "
                      "finish_reason 'stop', no call: run 6; a probe of 8 seeds: 3 began with the call, 4 ended "
                      "inside <think>, 1 still reasoned at 600 tokens), so the grammar never started; the "
                      "reasoning-gated grammar allows both first tokens"),
    _FC + "test_function_tool_use": ("model text", "SmolLM2 makes no hermes <tool_call> under tool_choice auto"),
    _FC + "test_tool_id_kimi_k2[": (
        "model text", "kimi_k2 ids are served (functions.<name>:<index>, run 5: 'functions.get_forecast:0'); the test "
                      "expects the model's two calls in one order (get_current_weather:0, get_forecast:1) and SmolLM2 "
                      "made one; run 6: the non-streamed case (no max_tokens) did not finish within 150 s on CPU"),
    _FC + "test_named_tool_use": (
        "model text", "the grammar-constrained arguments JSON is cut at the test's 1000 tokens (SmolLM2 keeps "
                      "writing inside a string)"),
    _ROOT + "test_chat_session_root_path_with_api_key[test_case0]": (
        "not applicable", "the key came from VLLM_API_KEY, which the shim did not pass on (it maps it to "
                          "TRTOPT_API_KEY since)"),
    _ROOT + "test_chat_session_root_path_with_api_key[test_case1]": (
        "not applicable", "the key came from VLLM_API_KEY, which the shim did not pass on (it maps it to "
                          "TRTOPT_API_KEY since)"),
    _ROOT + "test_chat_session_root_path_with_api_key": (
        "model text", "SmolLM2 continuing an open assistant turn (continue_final_message, no max_tokens) runs to "
                      "the context's end: finish_reason 'length', not 'stop' (run 6: past the 150 s limit on CPU)"),
    "tests/entrypoints/openai/completion/test_completion.py::test_single_completion": (
        "model text", "usage prompt_tokens is opt-125m's tokenization of the prompt"),
    "tests/entrypoints/openai/completion/test_completion.py::test_completion_streaming": (
        "model text", "SmolLM2 ends with EOS before max_tokens ('stop'); the test expects opt-125m's 'length'"),
    "tests/entrypoints/openai/completion/test_completion.py::test_parallel_": (
        "model text", "all n sampled completions ran to max_tokens=50, so their lengths do not differ"),
    "tests/entrypoints/openai/test_return_token_ids.py::test_chat_completion_with_tool_use": (
        "model text", "SmolLM2 writes no <tool_call>"),
    "tests/entrypoints/openai/test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs": (
        "model text", "SmolLM2's completion is EOS at once: token_ids decode to '<|im_end|>', the text (special "
                      "tokens skipped) has none of it"),
    "tests/entrypoints/openai/test_return_tokens_as_ids.py::test_responses_api_": (
        "not applicable", "a vLLM internal (_get_decoded_token) the shim stubs; /v1/responses is not served"),
    "tests/entrypoints/openai/test_chunked_prompt.py::": (
        "not applicable", "prompts of ~2800 tokens exceed a plan built with the default 2048-token max_model_len "
        "(a 400; with --max-model-len 8192, SmolLM2's context, both pass: run 7)"),
    "tests/entrypoints/serve/instrumentator/test_basic.py::test_request_cancellation": (
        "not applicable", "the test serves Qwen3-0.6B with --max-model-len 10100 and asks for 10,000 tokens; SmolLM2's "
        "context is 8192, so the request is a 400 (vLLM's answer for a model of that context too)"),
    "tests/entrypoints/serve/instrumentator/test_metrics.py::test_metrics_exist_run_batch": (
        "not applicable", "it runs `vllm run-batch` on /v1/embeddings with --enable-metrics; `trtopt run-batch` "
                          "exists for chat and completions, and trtopt serves no embeddings"),
    "tests/entrypoints/serve/instrumentator/test_metrics.py::test_metrics_exist": (
        "not applicable", "needs vLLM's local_asset_server fixture (multimodal assets), which the shim lacks"),
    "tests/entrypoints/serve/instrumentator/test_metrics.py::": (
        "not applicable", "the test loads the model's HF files itself (no network here)"),
    _MIDDLE + "test_v2_endpoint_accepts_valid_api_token": (
        "not applicable", "/v2/embed is an embeddings route; trtopt serves generation plans (past the key: a 404)"),
    "tests/entrypoints/openai/models/test_models.py::test_check_models": (
        "not applicable", "the model card has vLLM's root, parent and permission; the test also wants its LoRA "
                          "adapter listed after the base model (LoRA is not served)"),
    "tests/entrypoints/serve/instrumentator/test_sleep.py::test_sleep_mode": (
        "trtopt bug", "sleep level 1 on the torch backend is a 500: LLMEngine.release_kv_cache reallocates the pools "
                      "at 1 block, which the torch executor refuses (num_blocks must be >= 2)"),
    "tests/entrypoints/serve/tokenize/test_tokenization.py::": (
        "not applicable", "max_model_len is the plan's default 2048; the test expects the model's 8192 "
        "(a plan built with --max-model-len 8192 passes: run 7)"),
    "tests/tool_use/test_chat_completions.py::test_response_format_with_tool_choice_required": (
        "model text", "accepted now (the tool call's grammar replaces response_format, as in vLLM), but SmolLM2's "
                      "forced call did not close within max_completion_tokens=150: finish_reason 'length'"),
    "tests/tool_use/test_tool_calls.py::test_tool_call_and_choice": (
        "model text", "SmolLM2 makes no tool call in the parser's syntax (hermes, llama3_json, mistral, granite, "
                      "internlm, pythonic) under tool_choice auto"),
    "tests/tool_use/test_parallel_tool_calls.py::test_parallel_tool_calls": (
        "model text", "SmolLM2 makes no tool call in the parser's syntax under tool_choice auto"),
    "tests/tool_use/test_tool_choice_required.py::": (
        "not applicable", "unit tests of vLLM's own ChatCompletionRequest, which the shim stubs (pydantic cannot "
                          "build a schema for the stub)"),
    _CHAT + "internal": (
        "not applicable", "pytest INTERNALERROR in the test process, not the server: CPython 3.11.7's ast.parse "
                          "raised SystemError 'AST constructor recursion depth mismatch' while pytest formatted a "
                          "failure (or rewrote a late import) after a pytest-timeout had fired in the file; the rest "
                          "of the file did not run (run 6 reran it with -- -p no:hypothesispytest --tb=line)"),
}


def _read_vllm(root: Path, path: str) -> str | None:
    """One file of the vLLM tree: from a work tree, or through `git show HEAD:` from a (bare) git directory."""
    if (root / path).is_file():
        return (root / path).read_text()
    git_dir = root / ".git" if (root / ".git").exists() else root
    r = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def extract(vllm: Path, dest: Path, files: list[str]) -> list[str]:
    """Copy the test files and their package __init__s; return the files that exist in this vLLM."""
    found = []
    for path in files + SUPPORT:
        text = _read_vllm(vllm, path)
        if text is None:
            print(f"not in this vLLM: {path}")
            continue
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
        parts = Path(path).parts
        for i in range(1, len(parts)):
            init = dest.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")
        if path in files:
            found.append(path)
    return found


UTILS_PY = r'''
"""vLLM's tests/utils.py, only as far as the server tests need: RemoteOpenAIServer starts `trtopt serve`."""
import contextlib, json, os, signal, socket, subprocess, sys, time
from pathlib import Path

import openai, pytest, requests

PLAN = os.environ["VLLM_SUITE_PLAN"]
TRTOPT = os.environ["VLLM_SUITE_TRTOPT"]
VLLM_PATH = Path(__file__).resolve().parent.parent
ROCM_ENV_OVERRIDES: dict = {}
ROCM_EXTRA_ARGS: list = []
# The plan's compiled limits: a larger vLLM value is clamped to them (printed as "clamped").
_LIMITS = json.loads((Path(PLAN) / "plan.json").read_text())["limits"]
_CLAMP = {"--max-model-len": _LIMITS["max_model_len"], "--max-num-seqs": _LIMITS["max_num_seqs"],
          "--max-num-batched-tokens": _LIMITS["max_num_tokens"]}

# vLLM flag -> trtopt flag, for flags that take a value and mean the same.
_VALUE = {"--port": "--port", "--host": "--host", "--api-key": "--api-key", "--root-path": "--root-path",
          "--max-num-seqs": "--max-num-seqs", "--max-num-batched-tokens": "--max-num-batched-tokens",
          "--tool-call-parser": "--tool-call-parser", "--reasoning-parser": "--reasoning-parser",
          "--speculative-config": "--speculative-config", "--max-model-len": "--max-model-len",
          "--max-logprobs": "--max-logprobs"}
_BOOL = {"--enable-auto-tool-choice", "--enable-server-load-tracking", "--enable-force-include-usage",
         "--enable-tokenizer-info-endpoint", "--trust-request-chat-template", "--return-tokens-as-token-ids",
         "--enable-request-id-headers", "--enable-sleep-mode"}
_BOOL_RENAMED = {"--enforce-eager": "--eager"}


def _get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def map_args(model: str, vllm_args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """vLLM serve args -> (trtopt serve args, dropped args, LoRA module names)."""
    out, dropped, loras, names = [], [], [], []
    args = []
    for a in vllm_args:  # --flag=value -> --flag value
        args.extend(a.split("=", 1) if a.startswith("--") and "=" in a else [a])
    i = 0
    while i < len(args):
        a = args[i].replace("_", "-") if args[i].startswith("--") else args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        takes_value = nxt is not None and not nxt.startswith("--")
        if a in _VALUE and takes_value:
            v = nxt
            if a in _CLAMP and int(nxt) > _CLAMP[a]:
                v = str(_CLAMP[a])
                dropped.append(f"{a} {nxt} (clamped to {v})")
            out += [_VALUE[a], v]
            i += 2
        elif a in _BOOL:
            out.append(a)
            i += 1
        elif a in _BOOL_RENAMED:
            out.append(_BOOL_RENAMED[a])
            i += 1
        elif a == "--served-model-name":
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                names.append(args[i])
                i += 1
        elif a == "--lora-modules":
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                loras.append(args[i].split("=", 1)[0] if "=" in args[i] else json.loads(args[i])["name"])
                i += 1
        else:  # a flag trtopt has no equivalent for: drop it and its values
            dropped.append(a)
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                dropped.append(args[i])
                i += 1
    out += ["--model-name", names[0] if names else model]
    return out, dropped, loras


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model, vllm_serve_args, *, env_dict=None, seed=0, auto_port=True,
                 max_wait_seconds=None, override_hf_configs=None):
        args = list(vllm_serve_args)
        if "--uds" in args:
            pytest.skip("N/A: unix-domain sockets (--uds) are not a trtopt serve option")
        if auto_port:
            args += ["--port", str(_get_open_port())]
        targs, dropped, self.loras = map_args(model, args)
        if (override_hf_configs or {}).get("model_type") in ("kimi_k2", "kimi_k25"):  # vLLM picks ids by model_type
            targs += ["--tool-call-id-type", "kimi_k2"]
        self.host = targs[targs.index("--host") + 1] if "--host" in targs else "127.0.0.1"
        self.port = int(targs[targs.index("--port") + 1])
        self.uds = None
        self.show_hidden_metrics = False
        cmd = [TRTOPT, "serve", PLAN, "--kv-cache-memory-gb", "0.5", *targs]
        print(f"[shim] trtopt: {' '.join(cmd)}", flush=True)
        if dropped:
            print(f"[shim] dropped vLLM args: {dropped}", flush=True)
        env = {**os.environ, **(env_dict or {})}
        if "VLLM_API_KEY" in env:  # vLLM's environment spelling of --api-key
            env["TRTOPT_API_KEY"] = env["VLLM_API_KEY"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)
        self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)

    def _wait_for_server(self, *, url, timeout):
        start = time.time()
        while True:
            with contextlib.suppress(Exception):
                if requests.get(url, timeout=5).status_code == 200:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"trtopt serve exited with {self.proc.returncode}")
            if time.time() - start > timeout:
                self._shutdown()
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def url_root(self):
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts):
        # Leading/trailing slashes normalized, as vLLM's later tests/utils.py does: url_for("/v2/embed") at this
        # commit makes "//v2/embed", a 404 on vLLM too (its test_optional_middleware /v2 cases).
        return self.url_root + "/" + "/".join(p.strip("/") for p in parts)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_client_anthropic(self, **kwargs):
        pytest.skip("N/A: the Anthropic messages API is not served by trtopt")

    get_async_client_anthropic = get_client_anthropic


def _skip_mark(*args, **kwargs):
    return pytest.mark.skip(reason="N/A: needs several GPUs / FP8 / a large GPU (vLLM hardware mark)")


multi_gpu_only = multi_gpu_test = large_gpu_test = _skip_mark
requires_fp8 = pytest.mark.skip(reason="N/A: FP8 hardware mark")
large_gpu_mark = _skip_mark


def __getattr__(name):
    if name.startswith(("_", "pytest", "collect_")):
        raise AttributeError(name)
    from vllm._stub import Stub
    return Stub(f"tests.utils.{name}")
'''

CONFTEST_PY = r'''
"""Root conftest for vLLM's tests run against trtopt: no network, LoRA parameters not applicable."""
import os
import huggingface_hub
import pytest

_FAKE_HF = os.path.join(os.path.dirname(__file__), "..", "fake_hf")
os.makedirs(_FAKE_HF, exist_ok=True)
huggingface_hub.snapshot_download = lambda *a, **k: _FAKE_HF


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and "lora" in v.lower() for v in params.values()):
            item.add_marker(pytest.mark.skip(reason="N/A: LoRA adapters are not served by trtopt"))


class LocalAssetServer:
    def __init__(self, *a, **k):
        pytest.skip("N/A: multimodal asset server")


def __getattr__(name):
    if name.startswith(("_", "pytest", "collect_")):  # pytest's own hooks and pytest_plugins
        raise AttributeError(name)
    from vllm._stub import Stub
    return Stub(f"tests.conftest.{name}")
'''

SHIM_FILES = {
    "vllm/__init__.py": r'''
"""A stand-in for `vllm` (tests only): real answers for the names server tests use, a skip for the rest."""
import importlib.abc, importlib.machinery, sys, types

from vllm._stub import Stub, StubModule


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())  # last: real shim files win
from vllm.version import __version__  # noqa: E402


def __getattr__(name):
    return Stub(f"vllm.{name}")
''',
    "vllm/_stub.py": r'''
import types

import pytest


def _skip(name):
    pytest.skip(f"N/A: vLLM internal {name}", allow_module_level=True)


class Stub:
    """Any use (call, attribute of an instance) skips the test: it tests vLLM's own Python classes."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        _skip(self._name)

    def __getattr__(self, attr):
        if attr.startswith("_"):  # also _name itself on a copy made without __init__: no recursion
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        _skip(self._name)

    def _op(self, *a):
        _skip(self._name)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __lt__ = __le__ = __gt__ = __ge__ = _op
    __int__ = __index__ = __float__ = __len__ = __getitem__ = _op


class StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith(("_", "pytest")):
            raise AttributeError(attr)
        return Stub(f"{self.__name__}.{attr}")
''',
    "vllm/version.py": r'''
import importlib.metadata
__version__ = importlib.metadata.version("trtopt")  # /version answers the serving package's version


def _prev_minor_version():
    return "0.0"  # the metrics tests' hidden-metrics version flag (not mapped)
''',
    "vllm/tokenizers/__init__.py": r'''
import functools, os


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.environ["VLLM_SUITE_PLAN"])


def get_tokenizer(*args, **kwargs):
    """Whatever model the test names, the server runs the plan's model: its tokenizer."""
    return _tokenizer()


def __getattr__(name):
    from vllm._stub import Stub
    return Stub(f"vllm.tokenizers.{name}")
''',
    "vllm/config/__init__.py": r'''
import json, os


class ModelConfig:
    """Only get_vocab_size(), of the plan's model."""

    def __init__(self, *args, **kwargs):
        with open(os.path.join(os.environ["VLLM_SUITE_PLAN"], "config.json")) as f:
            self._cfg = json.load(f)

    def get_vocab_size(self):
        return self._cfg["vocab_size"]


def __getattr__(name):
    from vllm._stub import Stub
    return Stub(f"vllm.config.{name}")
''',
    "vllm/utils/__init__.py": r'''
def __getattr__(name):
    from vllm._stub import Stub
    return Stub(f"vllm.utils.{name}")
''',
    "vllm/utils/network_utils.py": r'''
import socket


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def __getattr__(name):
    from vllm._stub import Stub
    return Stub(f"vllm.utils.network_utils.{name}")
''',
    "vllm/platforms/__init__.py": r'''
class _Platform:
    device_type = "cpu"

    def is_rocm(self): return False
    def is_tpu(self): return False
    def is_cuda(self): return False
    def is_xpu(self): return False
    def is_cpu(self): return True
    def device_count(self): return 0
    def supports_fp8(self): return False
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        from vllm._stub import Stub
        return Stub(f"vllm.platforms.current_platform.{name}")


current_platform = _Platform()
''',
}


def write_shim(dest: Path) -> None:
    (dest / "tests").mkdir(parents=True, exist_ok=True)
    (dest / "tests" / "__init__.py").write_text("")
    (dest / "tests" / "utils.py").write_text(UTILS_PY.lstrip())
    (dest / "tests" / "conftest.py").write_text(CONFTEST_PY.lstrip())
    for rel, text in SHIM_FILES.items():
        p = dest / "shim" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.lstrip())
    (dest / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = "
                                     "module\nasyncio_default_test_loop_scope = module\n")


def run_file(dest: Path, path: str, *, plan: Path, per_test_s: int, per_file_s: int, extra: list[str]) -> dict:
    xml = dest / "results" / (path.replace("/", "__") + ".xml")
    log = xml.with_suffix(".log")
    xml.parent.mkdir(exist_ok=True)
    env = {**os.environ, "VLLM_SUITE_PLAN": str(plan),
           "VLLM_SUITE_TRTOPT": str(Path(sys.executable).parent / "trtopt"),
           "PYTHONPATH": os.pathsep.join([str(dest), str(dest / "shim"), str(dest / "site")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    # --tb=line and no hypothesis plugin: formatting a long report after a per-test timeout made Python 3.11's
    # ast.parse fail ("AST constructor recursion depth mismatch"), an INTERNALERROR that ended the file (run 6)
    cmd = ["timeout", str(per_file_s), sys.executable, "-m", "pytest", path, "-p", "no:cacheprovider", "-q",
           "-p", "no:hypothesispytest", "--tb=line", "-rs", f"--timeout={per_test_s}", f"--junitxml={xml}", *extra]
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=dest, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), "xml": str(xml), "log": str(log)}


_AUTO = [  # (regex over the failure text, kind, line)
    (r"N/A: ", "not applicable", None),
    (r"trtopt serve exited", "missing feature", "trtopt serve refused the mapped flags"),  # before: its log says timeout
    (r"timed? ?out|Timeout", "trtopt bug", "timed out (per-test limit)"),
    (r"Connection refused|ConnectError|APIConnectionError", "trtopt bug", "server unreachable / died"),
]


def _auto_cause(test_id: str, text: str) -> tuple[str, str]:
    for key, cause in sorted(CAUSES.items(), key=lambda kv: -len(kv[0])):
        if test_id.startswith(key):
            return cause
    for pat, kind, line in _AUTO:
        if re.search(pat, text):
            return kind, line or text.splitlines()[0][:160]
    return "unclassified", (text.strip().splitlines() or [""])[-1][:200]


def parse(xml_path: str, path: str) -> dict:
    res = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": [], "skips": {}}
    if not Path(xml_path).exists():
        return res
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        name = tc.get("name")
        test_id = f"{path}::{name}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        skip = tc.find("skipped")
        if bad is not None:
            res["failed" if bad.tag == "failure" else "errors"] += 1
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            kind, line = _auto_cause(test_id, text)
            res["failures"].append({"test": name, "kind": kind, "cause": line,
                                    "message": (bad.get("message") or "")[:300]})
        elif skip is not None:
            res["skipped"] += 1
            reason = (skip.get("message") or "")[:160]
            res["skips"][reason] = res["skips"].get(reason, 0) + 1
        else:
            res["passed"] += 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", type=Path, required=True, help="vLLM work tree or (bare) git directory")
    ap.add_argument("--plan", type=Path, required=True, help="plan directory from `trtopt build`")
    ap.add_argument("--dest", type=Path, default=Path("/tmp/vllm_suite"))
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: print)")
    ap.add_argument("--files", nargs="*", default=None, help="subset of FILES (default: all)")
    ap.add_argument("--per-test-s", type=int, default=180)
    ap.add_argument("--per-file-s", type=int, default=1500)
    ap.add_argument("--reparse", action="store_true", help="only re-read the XML of an earlier run")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    a = ap.parse_args()
    files = a.files or FILES
    if not a.reparse:
        a.dest.mkdir(parents=True, exist_ok=True)
        files = extract(a.vllm, a.dest, files)
        write_shim(a.dest)
    results = {}
    for path in files:
        run = {} if a.reparse else run_file(a.dest, path, plan=a.plan, per_test_s=a.per_test_s,
                                              per_file_s=a.per_file_s, extra=a.pytest_args)
        xml = run.get("xml") or str(a.dest / "results" / (path.replace("/", "__") + ".xml"))
        results[path] = {**parse(xml, path), **{k: v for k, v in run.items() if k in ("rc", "wall_s")}}
        r = results[path]
        print(f"{path}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped",
              flush=True)
    total = {k: sum(r[k] for r in results.values()) for k in ("passed", "failed", "errors", "skipped")}
    by_kind: dict[str, int] = {}
    for r in results.values():
        for f in r["failures"]:
            by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    doc = {"total": total, "failures_by_kind": by_kind, "files": results}
    if a.out:
        old = json.loads(a.out.read_text()) if a.out.exists() else {}
        merged = {**old.get("files", {}), **results} if a.files else results
        total = {k: sum(r[k] for r in merged.values()) for k in ("passed", "failed", "errors", "skipped")}
        by_kind = {}
        for r in merged.values():
            for f in r["failures"]:
                by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
        a.out.write_text(json.dumps({**{k: v for k, v in old.items() if k not in ("total", "failures_by_kind",
                                                                                     "files")},
                                     "total": total, "failures_by_kind": by_kind, "files": merged}, indent=1) + "\n")
    print(json.dumps({"total": total, "failures_by_kind": by_kind}))


if __name__ == "__main__":
    main()
