"""trtopt: TensorRT/ONNX graph optimization and a paged-KV runtime for LLM inference.

    from trtopt import LLM, SamplingParams
    llm = LLM("out/plan")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import trtopt` (and the CLI's start-up) does not pay for torch and transformers.
    if name == "LLM":
        from trtopt.runtime.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "RequestOutputKind"):
        from trtopt.runtime import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'trtopt' has no attribute {name!r}")
