"""PagedAttention on CPU (the torch executor's path): the reference's semantics in far fewer torch calls.

The torch reference (trtopt.plugins.paged_attention.reference) is the numerical truth but spends ~20 small torch
calls per sequence and layer; on a 2-core CPU those calls, not the FLOPs, dominate a decode step. Here:

- an all-decode step (one new token per sequence) runs as ONE batched SDPA over every sequence's blocks, gathered
  with one index op and masked by seq_lens (no per-sequence Python loop, whatever the batch size), unless the
  contexts are so uneven that the gather would copy mostly padding;
- any other step (prefill chunks mixed in) runs one SDPA per sequence, causal with the chunk's offset;
- GQA goes through SDPA's enable_gqa (no repeat_interleave copies).

ALiBi, sliding windows and non-causal attention are rare in the plans we run; they use the reference.
FP8 pools: the gathered blocks are dequantized (reference.from_pool: × scale in fp32) to q's dtype before SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtopt.plugins.paged_attention.reference import from_pool, paged_attention_ref, pool_values, write_kv


def _gather_blocks(kv_cache: torch.Tensor, tables: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first num_blocks blocks of each row of tables: two [S, Hkv, num_blocks·bs, D]."""
    blocks = kv_cache[tables[:, :num_blocks].long()]  # [S, nb, 2, Hkv, bs, D]
    S, nb, _, hkv, bs, d = blocks.shape
    keys = blocks[:, :, 0].transpose(1, 2).reshape(S, hkv, nb * bs, d)
    values = pool_values(blocks).transpose(1, 2).reshape(S, hkv, nb * bs, d)
    return keys, values


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            max_len: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """One query per sequence (row s of the T = S tokens belongs to sequence s)."""
    block_size = kv_cache.shape[3]
    keys, values = _gather_blocks(kv_cache, block_tables, -(-max_len // block_size))  # [S, Hkv, L, D]
    visible = torch.arange(keys.shape[2]) < seq_lens[:, None].to(torch.int64)  # [S, L]: the query is the last pos
    query = q[0].transpose(0, 1).unsqueeze(2)  # [S, Hq, 1, D]
    keys, values = from_pool(keys, k_scale, q.dtype), from_pool(values, v_scale, q.dtype)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None, None],
                                         scale=scale, enable_gqa=True)  # [S, Hq, 1, D]
    return out.squeeze(2).transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]


def _per_sequence(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, starts: list[int],
                  lens: list[int], scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)
    block_size = kv_cache.shape[3]
    for s, context_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n = hi - lo
        if n == 0:
            continue
        assert context_len >= n, f"sequence {s}: seq_lens={context_len} is shorter than its {n} new tokens"
        keys, values = _gather_blocks(kv_cache, block_tables[s : s + 1], -(-context_len // block_size))
        keys = from_pool(keys[:, :, :context_len], k_scale, q.dtype)
        values = from_pool(values[:, :, :context_len], v_scale, q.dtype)
        query = q[:, :, lo:hi]  # [1, Hq, n, D]
        if n == 1:
            mask, is_causal = None, False  # the last position sees every key
        elif n == context_len:
            mask, is_causal = None, True
        else:  # a chunk after cached tokens: query j sits at position context_len - n + j
            query_pos = torch.arange(context_len - n, context_len)
            mask, is_causal = torch.arange(context_len)[None, :] <= query_pos[:, None], False
        out[:, :, lo:hi] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                                          scale=scale, enable_gqa=True)
    return out


def paged_attention_cpu(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, *,
                        num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int = 1,
                        sliding_window: int = 0, alibi_slopes: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0):
    """Same contract as paged_attention_ref: writes kv_cache in place, returns (out [1, Hq, T, D], kv_cache)."""
    if alibi_slopes is not None and not bool(alibi_slopes.any()):
        alibi_slopes = None  # plans always wire the input; all-zero slopes add nothing
    if alibi_slopes is not None or sliding_window > 0 or not causal:
        return paged_attention_ref(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                                   num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                                   causal=causal, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                                   k_scale=k_scale, v_scale=v_scale)
    assert q.shape[1] == num_heads and k.shape[1] == num_kv_heads and q.shape[3] == head_dim, (
        f"q {tuple(q.shape)} / k {tuple(k.shape)} disagree with num_heads={num_heads}, "
        f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
    )
    write_kv(k, v, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if not lens:
        return torch.zeros_like(q), kv_cache
    if all(hi - lo == 1 for lo, hi in zip(starts, starts[1:])) and _padding_is_cheap(lens, kv_cache.shape[3]):
        return _decode(q, kv_cache, block_tables, seq_lens, max(lens), scale, k_scale, v_scale), kv_cache
    return _per_sequence(q, kv_cache, block_tables, starts, lens, scale, k_scale, v_scale), kv_cache


def _padding_is_cheap(lens: list[int], block_size: int) -> bool:
    """The batched decode gathers every sequence up to the longest one; with very uneven contexts (one long
    sequence among short ones) that copies mostly padding, and one SDPA per sequence is cheaper."""
    padded = len(lens) * -(-max(lens) // block_size) * block_size
    return padded <= 2 * sum(lens) + 4 * block_size * len(lens)
