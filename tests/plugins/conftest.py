"""Shared setup for the trtopt op tests.

Without CUDA the Triton kernels run under the Triton interpreter on CPU tensors. Triton decides between compiling
and interpreting when a kernel is decorated, i.e. when the kernel module is imported, so the variable must be set
before any test module imports one; a conftest is imported before its directory's test modules.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
