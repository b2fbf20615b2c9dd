"""The paged-KV LLM runtime (docs/architecture.md §6). `LLM` and `SamplingParams` are the public entry points.

Imports are lazy so that `import trtopt` stays cheap (no torch/transformers until they are used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtopt.runtime.config import EngineConfig
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.llm import LLM
    from trtopt.runtime.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "trtopt.runtime.llm",
    "LLMEngine": "trtopt.runtime.engine",
    "EngineConfig": "trtopt.runtime.config",
    "SamplingParams": "trtopt.runtime.sampling_params",
    "StructuredOutputsParams": "trtopt.runtime.sampling_params",
    "RequestOutputKind": "trtopt.runtime.sampling_params",
    "RequestOutput": "trtopt.runtime.batch",
    "CompletionOutput": "trtopt.runtime.batch",
    "EngineStats": "trtopt.runtime.batch",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trtopt.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
