"""RMSNorm, face 5 of DESIGN.md §4: deliberately NO TensorRT plugin.

RMSNorm has no Triton kernel (faces: schema, function, reference), so there is nothing to compile to PTX, and its
ONNX function body is standard ops TensorRT fuses well on its own (Cast, Mul, ReduceMean, Add, Sqrt, Reciprocal,
CastLike). TensorRT should therefore import a trtopt.RMSNorm node *as its local function*: the ONNX parser inlines
a node whose op_type names a local function, unless the node carries ``plugin_namespace`` (or the parser flag
ENABLE_PLUGIN_OVERRIDE is set, 10.15+), in which case it looks for a registered plugin instead.

Consequence, for the fusion and plan owners (not changed here): RMSNorm nodes must NOT carry
``plugin_namespace="trtopt"``. Today they do (trtopt/fusion_passes/rms_norm.py via ``plugin_namespace=DOMAIN``,
and trtopt/plugins/common.normalize_attributes adds it to every trtopt node), so TensorRT would fail to parse a
plan with RMSNorm ("plugin not found"). On opset >= 23 the fusion emits the standard RMSNormalization instead,
which TensorRT imports natively.

Importing this module registers nothing; it exists so that the TensorRT executor, which imports
``trtopt.plugins.<op>.trt_plugin`` for every trtopt op in a plan, finds this explanation instead of an ImportError.
"""

# Read by tests and by anyone deciding whether a node of this op may carry plugin_namespace.
HAS_TENSORRT_PLUGIN = False
