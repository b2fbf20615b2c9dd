"""Fixtures for the executor tests: tiny exports (shared session fixture `export_dir`) built into plans once."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtopt.build.plan import Limits


@pytest.fixture(scope="session")
def plan_dir(export_dir, tmp_path_factory):
    """plan_dir(model, exporter="dynamo") → Path of a plan built from the shared export (block_size 16)."""
    from trtopt.build.builder import build_plan

    cache: dict[tuple[str, str], Path] = {}

    def get(model: str, exporter: str = "dynamo") -> Path:
        key = (model, exporter)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"plan-{model}-{exporter}")
            limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
            cache[key] = build_plan(export_dir(model, exporter), out, limits=limits, force=True,
                                    progress=False).plan_dir
        return cache[key]

    return get
