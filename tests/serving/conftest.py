"""Serving fixtures: one tiny-llama plan and one live `trtopt serve` subprocess per test session (127.0.0.1 only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_server import API_KEY, start_server

NUM_BLOCKS = 40  # 39 usable (a 512-token sequence needs 32): the 50-client load test makes the scheduler preempt


@pytest.fixture(scope="session")
def tiny_plan(export_dir, tmp_path_factory) -> Path:
    from trtopt.builder.pipeline import build_plan

    out = tmp_path_factory.mktemp("serving") / "tiny-plan"
    build_plan(export_dir("tiny-llama"), out, progress=False)
    return out


@pytest.fixture(scope="session")
def server(tiny_plan, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve-log") / "serve.log"
    srv = start_server(tiny_plan, log_path, "--api-key", API_KEY, "--num-blocks", str(NUM_BLOCKS),
                       "--max-body-bytes", "65536")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the session's tiny server."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(tiny_plan):
    """The tiny plan's tokenizer (SmolLM2's), as the server loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_plan)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer and chat template, without building a plan (the scripted engines' tokenizer)."""
    from transformers import AutoTokenizer

    from trtopt.export.models import ALIASES

    return AutoTokenizer.from_pretrained(ALIASES["tiny-llama"]())
