"""flash_attention_ref against torch's scaled_dot_product_attention (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trtopt.plugins.flash_attention.reference import flash_attention_ref


def sdpa(q, k, v, bias, *, scale, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = bias
    if causal:
        seq_q, seq_k = q.shape[2], k.shape[2]
        allowed = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(diagonal=seq_k - seq_q)
        causal_bias = torch.zeros(seq_q, seq_k).masked_fill(~allowed, float("-inf"))
        mask = causal_bias if mask is None else mask + causal_bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("seq_q,seq_k", [(7, 7), (3, 11), (1, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_sdpa(num_heads, num_kv_heads, causal, seq_q, seq_k, with_bias):
    gen = torch.Generator().manual_seed(num_heads + 10 * seq_q + 100 * seq_k + causal)
    batch, head_dim = 2, 16
    q = torch.randn(batch, num_heads, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, num_kv_heads, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, num_kv_heads, seq_k, head_dim, generator=gen)
    bias = None
    if with_bias:
        # A BERT-style key-padding mask: batch row 1 has its last 2 keys padded.
        keep = torch.ones(batch, 1, 1, seq_k)
        keep[1, ..., -2:] = 0
        bias = (1.0 - keep) * torch.finfo(torch.float32).min
    scale = 1.0 / math.sqrt(head_dim)
    out = flash_attention_ref(q, k, v, bias, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, scale=scale, causal=causal)
    torch.testing.assert_close(out, sdpa(q, k, v, bias, scale=scale, causal=causal), atol=1e-5, rtol=1e-5)


def test_full_bias_and_custom_scale():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5, generator=gen)
    out = flash_attention_ref(q, k, v, bias, num_heads=2, num_kv_heads=2, head_dim=8, scale=0.3)
    torch.testing.assert_close(out, sdpa(q, k, v, bias, scale=0.3, causal=0), atol=1e-5, rtol=1e-5)


def test_fp16_in_fp16_out():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 6, 32, generator=gen) for _ in range(3))
    out = flash_attention_ref(q.half(), k.half(), v.half(), num_heads=4, num_kv_heads=4, head_dim=32,
                              scale=32**-0.5, causal=1)
    assert out.dtype == torch.float16
    expected = sdpa(q.half().float(), k.half().float(), v.half().float(), None, scale=32**-0.5, causal=1)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
