"""The error tiers of docs/architecture.md §7.

Internal invariants are plain ``assert``s. Caller and input mistakes raise a ``TrtOptError`` subclass whose
message says what was wrong *and what to do next*; the CLI prints it without a traceback and the HTTP server
maps it to a 4xx. Expected back-pressure is a ``None``/``False`` return, never an exception.
"""


class TrtOptError(Exception):
    """Base class for every user-facing trtopt error."""


class ExportError(TrtOptError):
    """HF model → ONNX export failed, or the export does not match PyTorch."""


class FusionError(TrtOptError):
    """A graph could not be fused into the form the build needs."""


class BuildError(TrtOptError):
    """The plan directory could not be built or read."""


class QuantizeError(TrtOptError):
    """A model cannot be quantized as asked (no quantizable MatMul, bad group size, already quantized...)."""


class ConfigError(TrtOptError):
    """An option or configuration value is invalid."""


class RequestError(TrtOptError):
    """A generation request is invalid (bad prompt, bad sampling values, too long...)."""


class WorkerDiedError(TrtOptError):
    """A tensor-parallel worker process exited; the engine cannot go on with a partial group (restart it)."""
