"""trtopt::SiluMul: y = silu(gate) · up = gate · sigmoid(gate) · up, the SwiGLU activation of Llama-family MLPs.
ONNX has no SiLU (nor SwiGLU) op up to opset 23, so the plan carries this one. Faces: schema, function, reference,
kernel (Triton), trt_plugin (deliberately none: TensorRT fuses the body's pointwise ops itself)."""
