"""The tiny-llama export the quantize tests share (exported once per session by tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_export(export_dir):
    return export_dir("tiny-llama")
