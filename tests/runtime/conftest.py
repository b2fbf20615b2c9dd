"""Plan fixtures for the runtime's end-to-end tests: each plan is exported and built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def executor_for(built_plan):
    """executor_for(model, backend) -> a cached executor; engines re-allocate its KV pools, so it can be shared."""
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import create_executor

    cache: dict[tuple[str, str], object] = {}

    def get(model: str, backend: str):
        if (model, backend) not in cache:
            plan_dir = built_plan(model)
            cache[(model, backend)] = create_executor(backend, plan_dir, read_plan(plan_dir))
        return cache[(model, backend)]

    return get


@pytest.fixture(scope="session")
def engine_for(built_plan, executor_for):
    """engine_for(model, backend, **EngineConfig fields) -> a fresh LLMEngine on the shared executor."""
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.config import EngineConfig, load_tokenizer
    from trtopt.runtime.engine import LLMEngine

    tokenizers: dict[str, object] = {}

    def make(model: str, backend: str = "torch", **config) -> LLMEngine:
        plan_dir = built_plan(model)
        if model not in tokenizers:
            tokenizers[model] = load_tokenizer(plan_dir)
        return LLMEngine(executor_for(model, backend), read_plan(plan_dir), tokenizers[model], EngineConfig(**config))

    return make


@pytest.fixture(scope="session")
def smollm2_engine(engine_for):
    """smollm2_engine(backend="torch", **EngineConfig fields) -> a fresh LLMEngine on the real SmolLM2-135M plan,
    with max_model_len=256 unless given (the tests' prompts are short: a smaller KV pool)."""
    return lambda backend="torch", **cfg: engine_for("smollm2-135m", backend, **{"max_model_len": 256, **cfg})


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(model) -> the HF PyTorch model behind an export alias (fp32, eval), cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtopt.export.models import resolve_model

    cache: dict[str, object] = {}

    def get(model: str):
        if model not in cache:
            cache[model] = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()
        return cache[model]

    return get
