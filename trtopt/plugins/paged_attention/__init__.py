"""trtopt::PagedAttention: the paged-KV attention op (docs/architecture.md §4). Faces: schema, function, reference,
kernel."""
