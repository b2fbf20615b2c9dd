"""QMatMul, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin.

TensorRT's explicit quantization wants to see the standard Q/DQ → MatMul pattern and fuse it into a quantized GEMM
(FP8, or INT4 weight-only) with its own kernel selection; a plugin would hide exactly that. QMatMul nodes therefore
carry no ``plugin_namespace`` (``SCHEMA.tensorrt_plugin=False``) and the ONNX parser inlines the function body, as for
MatMulAdd and RMSNorm. The body picks the activation form with If on two bool initializer inputs (act_quantized,
act_static; see function.py): the parser imports only the taken branch of an If whose condition is weights, so the
network holds the same Q/DQ layers as the unfused graph. (onnx-tensorrt's If importer has that constant-condition
path; a TensorRT build of a quantized plan has not been run yet.)

Importing this module registers nothing; it exists so that the TensorRT executor, which imports
``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds this explanation instead of an ImportError.
"""

HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
