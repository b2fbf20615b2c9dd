"""HF causal LM → ONNX (optimum-style I/O), with built-in model aliases and a parity check against PyTorch."""

from trtopt.export.exporter import ExportResult, export_model
from trtopt.export.models import ALIASES, resolve_model

__all__ = ["ALIASES", "ExportResult", "export_model", "resolve_model"]
