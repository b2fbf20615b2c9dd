"""AddRMSNorm, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin.

The body is the residual Add followed by trtopt::RMSNorm's standard-op body, which TensorRT's own fusions turn into
a normalization kernel with the add folded in (its pointwise and reduction fusions see the whole chain once the
function is inlined); a plugin would be an opaque layer between the GEMM that produces x and the next GEMM. TensorRT
should therefore import a trtopt.AddRMSNorm node *as its local function*: the ONNX parser inlines a node whose
op_type names a local function unless the node carries ``plugin_namespace`` (or the parser flag
ENABLE_PLUGIN_OVERRIDE is set, 10.15+). AddRMSNorm nodes do not carry it: the schema says
``tensorrt_plugin=False``, which ``trtopt.plugins.common.normalize_attributes`` and the fusion rule follow, and the
TensorRT executor imports plugin modules only for ops with ``tensorrt_plugin=True``.

The Triton kernel (kernel.py) is the torch executor's CUDA path. Importing this module registers nothing; it exists
so that the TensorRT executor, which imports ``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds
this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
