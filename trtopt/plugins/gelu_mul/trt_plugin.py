"""GeluMul, face 5 of docs/architecture.md §4: deliberately NO TensorRT plugin, for SiluMul's reasons
(plugins/silu_mul/trt_plugin.py).

The body (Gelu at opset ≥ 20, else the exported Pow/Mul/Add/Tanh or Div/Erf chain, then Where and the Mul by up) is
pointwise ops, which TensorRT's own pointwise fusion merges into one kernel (and into the neighbouring GEMM's epilogue
where its tactics allow); a plugin would be an opaque layer that blocks exactly that fusion. TensorRT therefore
imports a trtopt.GeluMul node *as its local function*: GeluMul nodes carry no ``plugin_namespace`` (the schema says
``tensorrt_plugin=False``, which ``trtopt.plugins.common.normalize_attributes`` and the fusion rule follow).

The Triton kernel (kernel.py) is the torch executor's CUDA path, where no graph compiler fuses the ops. Importing
this module registers nothing; it exists so that the TensorRT executor, which imports
``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin
