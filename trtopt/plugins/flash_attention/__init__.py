"""trtopt::FlashAttention: cache-free scaled dot-product attention (DESIGN.md §4). Faces: schema, function, reference, kernel."""
