"""MatMulAdd, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin.

MatMulAdd has no Triton kernel (faces: schema, function, reference), and its ONNX function body (MatMul → Add) is
exactly what TensorRT fuses into one GEMM with a bias epilogue by itself; a plugin would only hide the matmul from
TensorRT's own kernel selection. TensorRT should therefore import a trtopt.MatMulAdd node *as its local function*:
the ONNX parser inlines a node whose op_type names a local function, unless the node carries ``plugin_namespace``
(or the parser flag ENABLE_PLUGIN_OVERRIDE is set, 10.15+), in which case it looks for a registered plugin.

So MatMulAdd nodes do not carry ``plugin_namespace``: its schema says ``tensorrt_plugin=False``, which
``trtopt.plugins.common.normalize_attributes`` and the fusion rule (trtopt/fusion_passes/matmul_add.py) follow, and the
TensorRT executor imports plugin modules only for ops with ``tensorrt_plugin=True``.

Importing this module registers nothing; it exists so that the TensorRT executor, which imports
``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
