"""The greedy argmax kernel (runtime/kernels/argmax_triton.py) against torch.argmax: the same index, bit for bit, for
ties, ±inf, NaN and signed zeros, over rows cut into many pieces. Without CUDA the kernel runs under the Triton
interpreter (set here before the kernel module is imported) with small pieces; the `gpu` test uses the real sizes."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.runtime.kernels.argmax import greedy_argmax  # noqa: E402
from trtopt.runtime.kernels.argmax_triton import argmax_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPECIALS = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4e38, -3.4e38, 1e-45]


@st.composite
def logits_rows(draw) -> torch.Tensor:
    """Small rows where ties are the rule: values from a short list (specials included) or a few integers."""
    n = draw(st.integers(1, 4))
    v = draw(st.integers(1, 80))
    pool = draw(st.sampled_from([SPECIALS, [0.0, 1.0, 2.0], [-0.0, 0.0], [float("-inf")], [5.0, float("nan")]]))
    values = draw(st.lists(st.sampled_from(pool), min_size=n * v, max_size=n * v))
    return torch.tensor(values, dtype=torch.float32).reshape(n, v)


@settings(max_examples=60, deadline=None)
@given(x=logits_rows(), chunk=st.sampled_from([16, 32, 64]))
def test_same_index_as_torch_argmax(x: torch.Tensor, chunk: int) -> None:
    x = x.to(DEVICE)
    assert torch.equal(argmax_triton(x, chunk=chunk), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,v,chunk", [(1, 1000, 64), (3, 129, 16), (5, 4096, 512), (2, 7, 16), (1, 4097, 4096)])
def test_random_rows_in_every_dtype(n: int, v: int, chunk: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * v)
    x = torch.randn(n, v, generator=gen).to(DEVICE, dtype)
    x[:, v // 3] = x[:, v // 2] = x.max() if v > 2 else x[:, 0]  # a tie across pieces
    assert torch.equal(argmax_triton(x, chunk=chunk), x.argmax(dim=-1))


def test_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="unit last stride"):
        argmax_triton(torch.zeros(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="float"):
        argmax_triton(torch.zeros(2, 8, dtype=torch.int64, device=DEVICE))
    assert argmax_triton(torch.zeros(0, 8, device=DEVICE)).shape == (0,)


def test_greedy_argmax_is_torch_argmax_off_cuda() -> None:
    x = torch.randn(3, 5000)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("argmax_kernel", [True, False])
def test_the_sampler_takes_greedy_rows_with_its_own_argmax_option(monkeypatch, argmax_kernel: bool) -> None:
    """Sampler(argmax_kernel=...) is the switch of its argmax (benchmarks' torch.argmax ablation): every greedy
    argmax it takes, plain greedy batches (sync and async) and rows it processes first, passes it on; the tokens
    are torch.argmax's either way."""
    from trtopt.runtime import sampler as sampler_module
    from trtopt.runtime.request import Request
    from trtopt.runtime.sampling_params import SamplingParams

    kernels = []

    def spy(logits, out=None, *, kernel=True):
        kernels.append(kernel)
        return greedy_argmax(logits, out, kernel=kernel)

    monkeypatch.setattr(sampler_module, "greedy_argmax", spy)
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(5))
    plain = [Request(str(i), [3, 4], SamplingParams(temperature=0.0), eos_token_ids=(0,), max_model_len=100)
             for i in range(2)]
    penalised = [Request("p", [3, 4], SamplingParams(temperature=0.0, presence_penalty=0.5), eos_token_ids=(0,),
                         max_model_len=100)]
    s = sampler_module.Sampler(argmax_kernel=argmax_kernel)
    assert [t.token_id for t in s(x, plain)] == x.argmax(-1).tolist()
    assert [t.token_id for t in s.sample_async(x, plain).resolve()] == x.argmax(-1).tolist()
    assert s(x[:1], penalised)[0].token_id >= 0
    assert kernels == [argmax_kernel] * 3


def test_writes_into_a_given_buffer() -> None:
    """out= (a CUDA graph's fixed token buffer): the answer lands in a view of it, nothing else is touched, and a
    buffer of the wrong shape or dtype is refused."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    buffer = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax_triton(x, chunk=64, out=buffer[:3]).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:3], x.argmax(dim=-1)) and buffer[3:].eq(-7).all()
    buffer.fill_(-7)
    assert greedy_argmax(x, out=buffer[:3]).data_ptr() == buffer.data_ptr()  # torch.argmax's out off CUDA
    assert torch.equal(buffer[:3], x.argmax(dim=-1)) and buffer[3:].eq(-7).all()
    with pytest.raises(ValueError, match="contiguous int64"):
        argmax_triton(x, out=buffer[:2])
    with pytest.raises(ValueError, match="contiguous int64"):
        argmax_triton(x, out=torch.zeros(3, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("n", [1, 8, 256])
@pytest.mark.parametrize("v", [49152, 128256, 151936, 262144])
def test_gpu_real_vocabularies(n: int, v: int) -> None:
    """The engine's path (greedy_argmax on CUDA) at real vocabulary sizes: SmolLM2, Llama-3, Qwen2, Gemma-3."""
    gen = torch.Generator(device="cuda").manual_seed(v + n)
    x = torch.randn(n, v, device="cuda", generator=gen)
    x[0, v - 1] = x[0, 17] = x[0].max() + 1  # a tie between the first and the last piece
    if n > 1:
        x[1, 4096 * 3 + 5] = float("nan")
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    assert torch.equal(greedy_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    assert torch.equal(greedy_argmax(x, kernel=False), x.argmax(dim=-1))  # torch.argmax itself (the ablation)
