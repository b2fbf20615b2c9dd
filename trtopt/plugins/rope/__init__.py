"""trtopt::Rope: rotary position embedding as HF's apply_rotary_pos_emb writes it, y = x·cos + rotate_half(x)·sin
along the last axis, with the exported graph's rounding. ONNX's RotaryEmbedding exists only from opset 23 (our
exports are 17/18), so the plan carries this op. Faces: schema, function, reference, kernel (Triton), trt_plugin
(deliberately none: TensorRT fuses the inlined body's slices and pointwise ops itself)."""
