"""trtopt::QMatMul: y = Q/DQ(x) @ DQ(w_q) for a quantized weight (FP8 E4M3 per output channel, INT4/UINT4 blocked
over K) and an optional FP8 activation quantization (static per-tensor or dynamic per-token). Faces: schema,
function, reference, kernel (a Triton GEMV for one-row steps; larger steps a tensor-core GEMM, gemm.py: a Triton
tl.dot GEMM dequantizing in registers, torch._scaled_mm for FP8 W8A8 prefill).

TensorRT face: deliberately no plugin (see trt_plugin.py). A QMatMul node carries no ``plugin_namespace``, so the
TensorRT parser inlines its function body, and TensorRT sees the standard Q/DQ → MatMul it fuses into a quantized
GEMM itself, as it does for RMSNorm and MatMulAdd (docs/architecture.md §3 "plugin_namespace only where a plugin
exists", §4).
"""
