"""FlashAttention, face 3 of docs/architecture.md §4: the plain torch reference (scaled dot-product attention, no
cache)."""

from __future__ import annotations

import torch


def flash_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: torch.Tensor | None = None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: int = 0,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + attn_bias [+ causal mask]) · v, accumulated in fp32.

    q: [B, Hq, S, D]; k, v: [B, Hkv, Sk, D]; attn_bias: additive, broadcastable to [B, Hq, S, Sk] (e.g. a
    [B, 1, 1, Sk] key-padding mask) or None. Causal means query i sees keys j <= i + (Sk − S), i.e. the queries
    are the last S positions of the Sk keys. Returns [B, Hq, S, D] in q's dtype.
    """
    assert q.shape[1] == num_heads and k.shape[1] == num_kv_heads and q.shape[3] == head_dim, (
        f"q {tuple(q.shape)} / k {tuple(k.shape)} disagree with num_heads={num_heads}, "
        f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
    )
    assert num_heads % num_kv_heads == 0, f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    group = num_heads // num_kv_heads
    seq_q, seq_k = q.shape[2], k.shape[2]

    keys = k.float().repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]: head h reads kv head h // group
    values = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ keys.transpose(-1, -2) * scale  # [B, Hq, S, Sk]
    if attn_bias is not None:
        scores = scores + attn_bias.float()
    if causal:
        query_pos = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
        key_pos = torch.arange(seq_k, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)
