"""trtopt::AddRMSNorm: the residual add and the RMSNorm that reads it, as one op with two outputs
(y = RMSNorm(x + residual), sum = x + residual). Faces: schema, function, reference, kernel (Triton),
trt_plugin (deliberately none: TensorRT fuses the inlined body's add and norm itself)."""
