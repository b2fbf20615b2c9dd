"""Post-training quantization of an exported model into standard Q/DQ ONNX (`trtopt quantize`)."""

from trtopt.quantize.api import QuantizeConfig, QuantizeResult, quantize_model

__all__ = ["QuantizeConfig", "QuantizeResult", "quantize_model"]
