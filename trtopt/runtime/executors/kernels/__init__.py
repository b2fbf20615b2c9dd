"""Triton kernels of the torch executor's own fusions (ops that are not trtopt ops)."""
