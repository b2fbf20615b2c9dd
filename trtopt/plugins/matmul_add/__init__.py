"""trtopt::MatMulAdd: y = x @ weight + bias for N-D x (a linear layer that Gemm cannot take because Gemm is 2-D).
Faces: schema, function, reference."""
