"""trtopt::PagedAttention: the paged-KV attention op (DESIGN.md §4). Faces: schema, function, reference, kernel."""
