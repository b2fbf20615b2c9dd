"""Shared fixtures. Exports are expensive, so each (model, exporter) pair is exported once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(model, exporter="dynamo") → directory of a verified export, shared by every test in the session."""
    from trtopt.export import export_model

    cache: dict[tuple[str, str], object] = {}

    def get(model: str, exporter: str = "dynamo"):
        key = (model, exporter)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"export-{model}-{exporter}")
            cache[key] = export_model(model, out, exporter=exporter, force=True)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def export_dir(exported):
    """export_dir(model, exporter="dynamo") → Path of the export directory."""

    def get(model: str, exporter: str = "dynamo") -> Path:
        return exported(model, exporter).out_dir

    return get
