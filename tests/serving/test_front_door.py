"""Both front ends prepare a request on their own thread (STYLE.md 20, docs/architecture.md §6): tokenizing,
checking and compiling its structured-output grammar never run on the step thread that every running request shares.

In-process and fast: a model-free executor (zero logits) under an LLMEngine with SmolLM2's real tokenizer. The HTTP
app runs under Starlette's TestClient; the Triton model under a stand-in for Triton's `triton_python_backend_utils`
(the real one exists only inside Triton's Python stub; tests/serving/test_triton.py runs the real server).
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import threading
import types

import numpy as np
import pytest
import torch

from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from trtopt.serving.engine_loop import EngineLoop

pytest.importorskip("xgrammar")

VOCAB = 49152  # SmolLM2's
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
FINAL = 1  # the stand-in's TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ZeroExecutor(Executor):
    """All-zero logits: greedy picks the lowest token id the grammar allows. Records the threads that step it."""

    def __init__(self) -> None:
        self.step_threads: set[threading.Thread] = set()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def copy_blocks(self, pairs) -> None:
        pass

    def execute(self, step: StepInputs) -> torch.Tensor:
        self.step_threads.add(threading.current_thread())
        return torch.zeros(len(step.logits_indices), VOCAB)  # [N, vocab]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trtopt.export.models import ALIASES

    return AutoTokenizer.from_pretrained(ALIASES["tiny-llama"]())  # SmolLM2's tokenizer and chat template


@pytest.fixture
def engine(tokenizer) -> tuple[LLMEngine, ZeroExecutor]:
    plan = PlanConfig(
        model=ModelFacts(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, vocab_size=VOCAB, dtype="float32",
                         eos_token_ids=(2,)),
        limits=Limits(block_size=4, max_num_tokens=256, max_num_seqs=8, max_model_len=256),
    )
    executor = ZeroExecutor()
    return LLMEngine(executor, plan, tokenizer, EngineConfig(num_blocks=128)), executor


@pytest.fixture
def compiles(monkeypatch) -> list[threading.Thread]:
    """The thread of every real grammar compile (and of building the compiler, which reads the vocabulary)."""
    from trtopt.runtime.structured_output import GrammarCompiler

    threads: list[threading.Thread] = []
    compile_, init = GrammarCompiler._compile, GrammarCompiler.__init__

    def spy_compile(self, spec):
        threads.append(threading.current_thread())
        return compile_(self, spec)

    def spy_init(self, *args, **kwargs):
        threads.append(threading.current_thread())
        init(self, *args, **kwargs)

    monkeypatch.setattr(GrammarCompiler, "_compile", spy_compile)
    monkeypatch.setattr(GrammarCompiler, "__init__", spy_init)
    return threads


def _assert_off_the_step_thread(compiles: list[threading.Thread], executor: ZeroExecutor) -> None:
    assert executor.step_threads, "no request was ever stepped"
    assert compiles, "no grammar was compiled: the spy is not on the compile path"
    on_step = [t.name for t in compiles if t in executor.step_threads]
    assert not on_step, f"grammars compiled on the step thread: {on_step}"


def test_prepare_compiles_on_the_caller_and_the_step_thread_reuses_it(engine, compiles):
    llm, executor = engine
    loop = EngineLoop(llm)
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        prepared = loop.prepare("Answer in JSON.", params)
        assert prepared.grammar is not None and prepared.prompt_token_ids == llm.input_processor.process(
            "Answer in JSON.", params).prompt_token_ids
        assert compiles == [threading.current_thread()] * 2  # the compiler built, then the grammar compiled
        done = threading.Event()
        loop.add("r", prepared, lambda out: done.set() if getattr(out, "finished", True) else None)
        assert done.wait(30)
    finally:
        loop.stop()
    _assert_off_the_step_thread(compiles, executor)
    assert len(compiles) == 2, "the step thread's add_request compiled the grammar a second time"


def test_the_http_server_never_compiles_on_the_step_thread(engine, compiles):
    from starlette.testclient import TestClient

    from trtopt.serving.server import create_app

    llm, executor = engine
    with TestClient(create_app(llm, "m")) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["Yes or no?", "No or yes?"], "max_tokens": 4,
                                                 "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4,
                                                 "structured_outputs": {"regex": "(unclosed"}})
        assert r.status_code == 400 and "could not be compiled" in r.json()["error"]["message"]
    _assert_off_the_step_thread(compiles, executor)


# ---- the Triton Python-backend model, under a stand-in for triton_python_backend_utils ----------------------------


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Response:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


class _Sender:
    def __init__(self) -> None:
        self.responses: list[_Response] = []
        self.done = threading.Event()

    def send(self, response: _Response | None = None, flags: int = 0) -> None:
        if response is not None:
            self.responses.append(response)
        if flags == FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, **inputs: object) -> None:
        self.inputs = {k: _Tensor(k, np.array([v], dtype=np.object_ if isinstance(v, bytes) else None))
                       for k, v in inputs.items()}
        self.sender = _Sender()

    def get_response_sender(self) -> _Sender:
        return self.sender


@pytest.fixture
def triton_model(monkeypatch):
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, _Error
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "trtopt.serving.triton_model", raising=False)
    yield importlib.import_module("trtopt.serving.triton_model")
    sys.modules.pop("trtopt.serving.triton_model", None)  # bound to the stand-in: never reused
    gc.unfreeze()  # initialize() froze the test process's objects


def test_the_triton_model_never_compiles_on_the_step_thread(engine, compiles, triton_model, monkeypatch, tmp_path):
    llm, executor = engine
    monkeypatch.setattr(triton_model, "LLMEngine", types.SimpleNamespace(from_plan=lambda *a, **k: llm))
    model = triton_model.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"plan_dir": {"string_value": "plan"}}}),
                      "model_repository": str(tmp_path), "model_version": "1", "model_instance_kind": "CPU",
                      "model_instance_device_id": "0", "model_instance_name": "trtopt_0"})
    schema = _Request(text_input=b"JSON please", max_tokens=np.int32(8), guided_decoding_guide_type=b"json_schema",
                      guided_decoding_guide=json.dumps(SCHEMA).encode())
    choice = _Request(text_input=b"Yes or no?", sampling_parameters=json.dumps(
        {"max_tokens": 4, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}).encode())
    bad = _Request(text_input=b"Hi", guided_decoding_guide_type=b"regex", guided_decoding_guide=b"(unclosed")
    try:
        model.execute([schema, choice, bad])
        for request in (schema, choice, bad):
            assert request.sender.done.wait(30)
    finally:
        model.finalize()
    assert [r.error for r in schema.sender.responses + choice.sender.responses] == [None, None]
    assert "could not be compiled" in bad.sender.responses[0].error.message  # the same user error as before
    _assert_off_the_step_thread(compiles, executor)
