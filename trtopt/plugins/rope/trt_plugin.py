"""Rope, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin.

The body is the exported RoPE subgraph (Slices, Neg, Concat, two Muls, Add), pointwise and data-movement ops that
TensorRT's own fusion merges into one kernel once the function is inlined; a plugin would be an opaque layer
between the Q/K projections and attention. TensorRT therefore imports a trtopt.Rope node *as its local function*:
the ONNX parser inlines a node whose op_type names a local function unless the node carries ``plugin_namespace``
(or the parser flag ENABLE_PLUGIN_OVERRIDE is set, 10.15+). Rope nodes do not carry it: the schema says
``tensorrt_plugin=False``, which ``trtopt.plugins.common.normalize_attributes`` and the fusion rule follow.

The Triton kernel (kernel.py) is the torch executor's CUDA path. Importing this module registers nothing; it exists
so that the TensorRT executor, which imports ``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds
this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
