"""Async scheduling's placeholder fill as one Triton launch (runtime/kernels/placeholders_triton.py) against the torch
ops of runtime.batch.fill_placeholders. Without CUDA the kernel runs under the Triton interpreter (set before the
kernel module is imported); the `gpu` test runs the engine's path, fill_placeholders_ on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.runtime.batch import fill_placeholders, fill_placeholders_  # noqa: E402
from trtopt.runtime.kernels.placeholders_triton import BLOCK, fill_placeholders_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@st.composite
def steps(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [1, T] with placeholders −1−k for k < n sampled tokens, anywhere and repeated; T across a block."""
    n = draw(st.integers(1, 6))
    t = draw(st.sampled_from([1, 2, 7, BLOCK - 1, BLOCK + 3]))
    ids = draw(st.lists(st.one_of(st.integers(0, 50_000), st.integers(-n, -1)), min_size=t, max_size=t))
    sampled = draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))
    return torch.tensor([ids], dtype=torch.int64), torch.tensor(sampled, dtype=torch.int64)


@settings(max_examples=25, deadline=None)
@given(step=steps())
def test_same_ids_as_the_torch_ops(step) -> None:
    ids, sampled = (x.to(DEVICE) for x in step)
    want = fill_placeholders(ids, sampled)
    got = fill_placeholders_triton(ids.clone(), sampled)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("t", [1, 64, 8192])
def test_gpu_engine_path_in_place(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    ids = torch.randint(0, 128256, (1, t), generator=gen)
    holes = torch.randperm(t, generator=gen)[: max(1, t // 3)]
    ids[0, holes] = -1 - torch.arange(holes.numel())
    sampled = torch.randint(0, 128256, (holes.numel(),), generator=gen)
    want = fill_placeholders(ids, sampled)
    dev = ids.cuda()
    assert fill_placeholders_(dev, sampled.cuda()) is dev
    assert torch.equal(dev.cpu(), want)
