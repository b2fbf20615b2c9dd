"""trtopt::FlashAttention: cache-free scaled dot-product attention (docs/architecture.md §4). Faces: schema, function,
reference, kernel."""
