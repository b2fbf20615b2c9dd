"""trtopt::GeluMul: y = gelu(gate) · up, the GeGLU activation of Gemma-family MLPs (``tanh=1``: GELU's tanh
approximation, HF's gelu_pytorch_tanh; ``tanh=0``: the exact erf GELU). ONNX has Gelu only from opset 20 (our exports
are 17/18) and no gated form at any opset, so the plan carries this op. Faces: schema, function, reference, kernel
(Triton), trt_plugin (deliberately none: TensorRT fuses the inlined body's pointwise ops itself)."""
