"""The FlashAttention Triton kernel vs the torch reference (the numerical truth).

Outputs are preallocated and poisoned with NaN, so a row the kernel skips cannot pass. Without CUDA these run
under the Triton interpreter (tests/plugins/conftest.py) on small shapes; the `gpu` sweep adds large,
half-precision shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from trtopt.plugins.flash_attention.kernel import flash_attention_triton
from trtopt.plugins.flash_attention.reference import flash_attention_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Case:
    batch: int
    num_heads: int
    num_kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: int
    bias: str = "none"  # "none" | "padding" ([B,1,1,Sk] with finfo.min on padded keys) | "full" ([B,Hq,S,Sk])
    dtype: torch.dtype = torch.float32
    seed: int = 0


def make_inputs(case: Case, device: torch.device):
    gen = torch.Generator().manual_seed(case.seed)
    B, Hq, Hkv, S, Sk, D = case.batch, case.num_heads, case.num_kv_heads, case.seq_q, case.seq_k, case.head_dim
    # q and k arrive as transposed views of [B, S, H, D] storage, as exported graphs hand them over.
    q = torch.randn(B, S, Hq, D, generator=gen).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).transpose(1, 2)
    v = torch.randn(B, Hkv, Sk, D, generator=gen)
    bias = None
    if case.bias == "padding":
        # HF-style mask: the last keys of each batch row are padding, masked with the dtype's most negative value.
        keep = torch.arange(Sk)[None, :] < torch.randint(1, Sk + 1, (B, 1), generator=gen)
        bias = torch.zeros(B, 1, 1, Sk).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    elif case.bias == "full":
        bias = torch.randn(B, Hq, S, Sk, generator=gen)
    to = dict(device=device, dtype=case.dtype)
    return q.to(**to), k.to(**to), v.to(**to), None if bias is None else bias.to(**to)


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


def run_both(case: Case, device: torch.device, use_tma: bool | None = None) -> None:
    q, k, v, bias = make_inputs(case, device)
    attrs = dict(num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                 scale=case.head_dim**-0.5, causal=case.causal)
    want = flash_attention_ref(q.cpu().float(), k.cpu().float(), v.cpu().float(),
                               None if bias is None else bias.cpu().float(), **attrs)
    out = torch.full((case.batch, case.num_heads, case.seq_q, case.head_dim), float("nan"), dtype=case.dtype,
                     device=device)
    got = flash_attention_triton(q, k, v, bias, out=out, use_tma=use_tma, **attrs)
    assert got is out
    assert not torch.isnan(got).any(), "NaN in the output: a row was skipped"
    torch.testing.assert_close(got.cpu().float(), want, **tolerance(case.dtype))


CASES = {
    "causal_mha": Case(1, 2, 2, 33, 33, 64, causal=1),
    "causal_gqa2_hd80": Case(2, 4, 2, 19, 19, 80, causal=1, seed=1),
    "causal_mqa_q_shorter": Case(1, 4, 1, 7, 40, 64, causal=1, seed=2),
    "noncausal_padding_bias": Case(2, 2, 2, 21, 21, 32, causal=0, bias="padding", seed=3),
    "noncausal_full_bias_gqa4": Case(1, 8, 2, 9, 26, 64, causal=0, bias="full", seed=4),
    "causal_bias_hd128": Case(1, 2, 1, 17, 17, 128, causal=1, bias="padding", seed=5),
    "single_query": Case(3, 2, 1, 1, 45, 96, causal=1, seed=6),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, kernel_device: torch.device) -> None:
    run_both(CASES[name], kernel_device)


TMA_CASES = {
    "causal_gqa2": Case(2, 4, 2, 37, 37, 64, causal=1, dtype=torch.float16, seed=20),
    "causal_q_shorter_hd128": Case(1, 2, 1, 5, 50, 128, causal=1, dtype=torch.float16, seed=21),
    "padding_bias": Case(2, 2, 2, 19, 19, 64, causal=0, bias="padding", dtype=torch.float16, seed=22),
}


@pytest.mark.parametrize("name", sorted(TMA_CASES))
def test_tma_path_matches_reference(name: str, kernel_device: torch.device) -> None:
    """The bulk-tensor-copy path (Hopper on GPU; the interpreter emulates descriptors on CPU)."""
    run_both(TMA_CASES[name], kernel_device, use_tma=True)


def test_rejects_bad_inputs(kernel_device: torch.device) -> None:
    q, k, v, _ = make_inputs(CASES["causal_mha"], kernel_device)
    attrs = dict(num_heads=2, num_kv_heads=2, head_dim=64, scale=0.125)
    with pytest.raises(ValueError, match="num_heads"):
        flash_attention_triton(q, k, v, **{**attrs, "num_heads": 4})
    with pytest.raises(ValueError, match="dtype"):
        flash_attention_triton(q, k.double(), v, **attrs)
    with pytest.raises(ValueError, match="k/v"):
        flash_attention_triton(q, k[:, :1], v[:, :1], **attrs)


GPU_SWEEP = [
    Case(*shape, dtype=dt, bias=bias, seed=i)
    for i, (shape, dt, bias) in enumerate([
        ((2, 32, 8, 1000, 1000, 128, 1), torch.bfloat16, "none"),
        ((1, 16, 16, 2048, 2048, 64, 1), torch.float16, "none"),
        ((4, 12, 12, 384, 384, 64, 0), torch.float16, "padding"),
        ((2, 20, 4, 517, 1531, 80, 1), torch.bfloat16, "none"),
        ((1, 8, 8, 300, 300, 96, 0), torch.float32, "full"),
        ((3, 16, 2, 129, 129, 128, 0), torch.float16, "none"),
        ((1, 32, 32, 4096, 4096, 128, 1), torch.bfloat16, "none"),
        ((8, 6, 6, 77, 77, 64, 1), torch.float32, "padding"),
    ])
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_SWEEP, ids=[f"sweep{i}" for i in range(len(GPU_SWEEP))])
def test_gpu_sweep_matches_reference(case: Case) -> None:
    run_both(case, torch.device("cuda"))
