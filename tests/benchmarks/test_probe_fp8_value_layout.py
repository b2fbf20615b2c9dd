"""benchmarks/probe_fp8_value_layout.py builds its kernel variants from attention.py's source: each replacement
finds the value load it replaces, and the variant modules import (no kernel runs; the timing needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_fp8_value_layout as probe  # noqa: E402


def test_variants_replace_the_value_load_and_import():
    for name, replacement in (("words", probe.WORDS), ("vt3", probe.VT3)):
        module = probe.variant(name, replacement)
        source = Path(module.__file__).read_text()
        assert source.count(probe.UNMASKED_V_LOAD.lstrip()) == 1 and replacement in source
        assert callable(module.paged_attention_triton) and module._paged_attn_kernel is not None
