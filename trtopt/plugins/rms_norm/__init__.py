"""trtopt::RMSNorm: y = scale · x / sqrt(mean(x², -1) + epsilon), for models below opset 23 (which has
RMSNormalization). Faces: schema, function, reference."""
