"""SiluMul, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin.

The body (Sigmoid → Mul → Mul) is three pointwise ops, which TensorRT's own pointwise fusion merges into one kernel
(and into the neighbouring GEMM's epilogue where its tactics allow); a plugin would be an opaque layer that blocks
exactly that fusion. TensorRT should therefore import a trtopt.SiluMul node *as its local function*: the ONNX
parser inlines a node whose op_type names a local function unless the node carries ``plugin_namespace`` (or the
parser flag ENABLE_PLUGIN_OVERRIDE is set, 10.15+). SiluMul nodes do not carry it: the schema says
``tensorrt_plugin=False``, which ``trtopt.plugins.common.normalize_attributes`` and the fusion rule follow, and the
TensorRT executor imports plugin modules only for ops with ``tensorrt_plugin=True``.

The Triton kernel (kernel.py) is the torch executor's CUDA path, where no graph compiler fuses the three ops.
Importing this module registers nothing; it exists so that the TensorRT executor, which imports
``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
