"""Shared fixtures. Exports are expensive, so each (model, exporter) pair is exported once per test session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# ---- every test file runs ------------------------------------------------------------------------------------------
# pytest silently skips folders matching norecursedirs (its default includes `build`, which hid tests/build). With
# TRTOPT_CHECK_COLLECTION=1 (set by `make test`), a run fails when a tests/**/test_*.py file was never collected.

_collected_files: set[str] = set()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.nodeid.endswith(".py"):
        _collected_files.add(report.nodeid)


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("TRTOPT_CHECK_COLLECTION") != "1":
        return
    root = Path(session.config.rootpath)
    expected = {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")}
    missing = sorted(expected - _collected_files)
    if missing:
        raise pytest.UsageError(f"{len(missing)} of {len(expected)} test files under tests/ were never collected: "
                                f"{missing}; check [tool.pytest.ini_options] norecursedirs in pyproject.toml.")


# ---- disk -----------------------------------------------------------------------------------------------------------
# One run used to leave ~7.5 GB of exports and plans under pytest's basetemp, and a CI run failed with a full disk's
# symptoms (setup errors in tests that only create a tmp_path). pyproject sets tmp_path_retention_policy = "failed"
# (a passing test's tmp_path is removed when it ends); module-scoped fixtures write under module_tmp, removed when
# the module ends. Only the session's shared exports and plans (tiny models, SmolLM2) live to the end.


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Path:
    """A directory for one test module's shared files, removed when the module's last test ends."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """tiny_hf_dir(arch) → Path of the HF dir of tests/export/tiny_archs.py's tiny random ``arch`` model (named
    ``tiny-<arch>``), written once per session; pass ``str(path)`` to the export/plan fixtures to share its exports."""
    here = str(Path(__file__).parent / "export")
    if here not in sys.path:
        sys.path.insert(0, here)
    from tiny_archs import save_tiny

    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = save_tiny(arch, tmp_path_factory.mktemp(f"hf-{arch}") / f"tiny-{arch}")
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(model, exporter="dynamo", dtype="fp32") → the ExportResult of an export with the default
    verification (bf16: recorded as unverified), shared by every test in the session. ``model`` is a built-in alias
    or an HF directory (as a string)."""
    from trtopt.export import export_model

    cache: dict[tuple[str, str, str], object] = {}

    def get(model: str, exporter: str = "dynamo", dtype: str = "fp32"):
        key = (model, exporter, dtype)
        if key not in cache:
            suffix = "" if dtype == "fp32" else f"-{dtype}"
            out = tmp_path_factory.mktemp(f"export-{Path(model).name}-{exporter}{suffix}")
            cache[key] = export_model(model, out, exporter=exporter, dtype=dtype, force=True)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def export_dir(exported):
    """export_dir(model, exporter="dynamo") → Path of the export directory."""

    def get(model: str, exporter: str = "dynamo") -> Path:
        return exported(model, exporter).out_dir

    return get


@pytest.fixture(scope="session")
def built_plan(export_dir, tmp_path_factory):
    """built_plan(model) -> plan dir built from the session's shared export of `model`."""
    from trtopt.builder.pipeline import build_plan

    cache: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in cache:
            out = tmp_path_factory.mktemp(f"plan-{Path(model).name}")
            cache[model] = build_plan(export_dir(model), out, force=True, progress=False).plan_dir
        return cache[model]

    return get


@pytest.fixture(scope="session")
def plan_dir(export_dir, tmp_path_factory):
    """plan_dir(model, exporter="dynamo") → Path of a plan built from the shared export (block_size 16)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits

    cache: dict[tuple[str, str], Path] = {}

    def get(model: str, exporter: str = "dynamo") -> Path:
        key = (model, exporter)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"plan-{Path(model).name}-{exporter}")
            limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
            cache[key] = build_plan(export_dir(model, exporter), out, limits=limits, force=True,
                                    progress=False).plan_dir
        return cache[key]

    return get


@pytest.fixture(scope="session")
def odd_vocab_model(tmp_path_factory):
    """odd_vocab_model() -> (HF dir, export dir) of a tiny tied-embedding Llama (GQA 4/2) whose vocabulary, GPT-2's
    50257 tokens with GPT-2's real tokenizer, divides by no tensor-parallel size > 1: a vocab-parallel LM head pads
    its last shard. Random weights scaled like trtopt's tiny aliases (peaked logits: greedy is decisive)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get() -> tuple[Path, Path]:
        if "model" not in cache:
            from transformers import LlamaConfig

            from trtopt.export import export_model
            from trtopt.export.models import _gpt2_tokenizer, save_random_tiny

            root = tmp_path_factory.mktemp("odd-vocab-llama")
            tok = _gpt2_tokenizer()
            config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=512, bos_token_id=50256, eos_token_id=50256)
            assert config.vocab_size == 50257
            save_random_tiny(config, tok, root / "hf")
            export_model(root / "hf", root / "export", force=True)
            cache["model"] = (root / "hf", root / "export")
        return cache["model"]

    return get
