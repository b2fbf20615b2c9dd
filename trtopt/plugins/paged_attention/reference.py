"""PagedAttention, face 3 of docs/architecture.md §4: the plain torch reference.

This is the numerical truth that the Triton kernel and the ONNX function body are tested against, and the op
that the torch executor runs on CPU. It favours clarity: one vectorised attention per sequence, fp32 math.

It reads ``query_start_loc`` and ``seq_lens`` on the host to slice per sequence (a synchronous ``.tolist()``),
so it is correct on CUDA too, just not capturable in a CUDA graph; the kernel is the path for that.

FP8 pools (float8_e4m3fn, schema.py's kv_cache_dtype="fp8"): ``to_pool`` is the write's quantization and
``from_pool`` the read's dequantization; every other face matches them. An FP8 pool also stores each block's values
transposed, [D, block_size] in the place of [block_size, D] (vLLM's value-cache layout): the attention's P·V dot
reduces over keys, and 8-bit tiles whose keys are contiguous load without a byte-by-byte transpose (attention.py).
``pool_values`` is the values in key order, as a view that writes go through.
"""

from __future__ import annotations

import functools

import torch

from trtopt.signature import FP8_E4M3_MAX, FP8_KV_DTYPE

FP8_POOL_DTYPE = getattr(torch, FP8_KV_DTYPE)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """New keys or values as a pool of ``pool_dtype`` stores them: a cast, or for an FP8 pool x / scale in fp32,
    saturated to ±448 (torch's cast alone would not promise it) and rounded to the nearest even float8_e4m3fn."""
    if pool_dtype != FP8_POOL_DTYPE:
        return x.to(pool_dtype)
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(pool_dtype)


def from_pool(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values in ``dtype``: a cast, or for an FP8 pool x × scale computed in fp32."""
    if x.dtype != FP8_POOL_DTYPE:
        return x.to(dtype)
    x = x.float()
    return (x if scale == 1.0 else x * scale).to(dtype)


def pool_values(kv: torch.Tensor) -> torch.Tensor:
    """The values of a pool, or of blocks gathered from one ([..., 2, Hkv, block_size, D]), as [..., Hkv,
    block_size, D] in key order: kv[..., 1, :, :, :], or for an FP8 pool that half read as [D, block_size] per
    block and transposed. A view (writes through it land in the pool); the (block_size, D) plane must be
    contiguous."""
    values = kv.select(-4, 1)
    if kv.dtype != FP8_POOL_DTYPE:
        return values
    *lead, block_size, head_dim = values.shape
    return values.view(*lead, head_dim, block_size).transpose(-1, -2)


def quantized_pool(pool: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """The FP8 pool that holds what the float pool ``pool`` [num_blocks, 2, Hkv, block_size, D] holds: keys
    k / k_scale and values v / v_scale as to_pool stores them, the values transposed as ``pool_values`` reads
    them. One half at a time (the fp32 temporaries are the peak memory), through byte views."""
    out = torch.empty(pool.shape, dtype=FP8_POOL_DTYPE, device=pool.device)
    out.view(torch.uint8)[:, 0] = to_pool(pool[:, 0], FP8_POOL_DTYPE, k_scale).view(torch.uint8)
    pool_values(out).view(torch.uint8).copy_(to_pool(pool[:, 1], FP8_POOL_DTYPE, v_scale).view(torch.uint8))
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write the K/V of every new token into the paged pool at its slot, in place; slot −1 is skipped.

    k, v: [1, Hkv, T, D]; kv_cache: [num_blocks, 2, Hkv, block_size, D]; slot_mapping: int64 [T].
    k_scale, v_scale: an FP8 pool's scales (to_pool); other pools ignore them.
    """
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # The advanced indices (blocks, 0, offsets) are split by a slice, so the selection is [n, Hkv, D].
    kv_cache[blocks, 0, :, offsets, :] = to_pool(k[0].transpose(0, 1)[keep], kv_cache.dtype, k_scale)
    pool_values(kv_cache)[blocks, :, offsets, :] = to_pool(v[0].transpose(0, 1)[keep], kv_cache.dtype, v_scale)


def gather_context(kv_cache: torch.Tensor, block_row: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``context_len`` cached keys and values of one sequence, in logical order: two [Hkv, L, D]."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-context_len // block_size)
    # index_select, not kv_cache[rows]: the advanced-indexing path is ~20x slower on CPU for this gather.
    blocks = kv_cache.index_select(0, block_row[:num_blocks].long())  # [nb, 2, Hkv, bs, D]
    keys = blocks[:, 0].transpose(0, 1).flatten(1, 2)[:, :context_len]  # [Hkv, L, D]
    values = pool_values(blocks).transpose(0, 1).flatten(1, 2)[:, :context_len]
    return keys, values


def attention_mask_bias(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    causal: int,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """The additive fp32 score bias [Hq or 1, n, L]: −inf where a key is hidden, ALiBi slope·(kpos − qpos) elsewhere."""
    rel = (key_pos[None, :] - query_pos[:, None]).float()  # [n, L]
    visible = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        visible &= rel <= 0
    if sliding_window > 0:
        visible &= rel > -sliding_window
    bias = torch.zeros_like(rel)[None]  # [1, n, L]
    if alibi_slopes is not None:
        bias = alibi_slopes.float()[:, None, None] * rel[None]  # [Hq, n, L]
    return bias.masked_fill(~visible[None], float("-inf"))


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: int = 1,
    sliding_window: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new K/V into the pool, then attend each new token over its sequence's cached keys.

    q: [1, Hq, T, D]; k, v: [1, Hkv, T, D]; kv_cache: [num_blocks, 2, Hkv, block_size, D] (WRITTEN IN PLACE);
    block_tables: int32 [S, max_blocks]; seq_lens: int32 [S] (context length after this step);
    query_start_loc: int32 [S+1]; slot_mapping: int64 [T] (−1 = do not write); alibi_slopes: float32 [Hq] or None;
    k_scale, v_scale: an FP8 pool's scales (to_pool / from_pool), ignored by other pools.
    Returns (out [1, Hq, T, D] in q's dtype, kv_cache) — the same pool object, so callers can alias it.
    """
    assert q.shape[1] == num_heads and k.shape[1] == num_kv_heads and q.shape[3] == head_dim, (
        f"q {tuple(q.shape)} / k {tuple(k.shape)} disagree with num_heads={num_heads}, "
        f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
    )
    assert num_heads % num_kv_heads == 0, f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    group = num_heads // num_kv_heads

    write_kv(k, v, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, context_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n = hi - lo
        if n == 0:
            continue
        assert context_len >= n, f"sequence {s}: seq_lens={context_len} is shorter than its {n} new tokens"
        keys, values = gather_context(kv_cache, block_tables[s], context_len)  # [Hkv, L, D]
        # Query head h = kv·group + g reads kv head h // group: view the queries as [Hkv, group·n, D].
        query = q[0, :, lo:hi].float().reshape(num_kv_heads, group * n, head_dim)

        query_pos = torch.arange(context_len - n, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        bias = attention_mask_bias(
            query_pos, key_pos, causal=causal, sliding_window=sliding_window, alibi_slopes=alibi_slopes
        )  # [Hq or 1, n, L]
        scores = (query @ from_pool(keys, k_scale, torch.float32).transpose(1, 2)).view(num_heads, n, context_len) * scale + bias  # [Hq, n, L]
        probs = scores.view(num_kv_heads, group * n, context_len).softmax(dim=-1)
        out[0, :, lo:hi] = (probs @ from_pool(values, v_scale, torch.float32)).view(num_heads, n, head_dim).to(q.dtype)
    return out, kv_cache


def rope_tables_fit(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int = 0) -> bool:
    """Whether the fused RoPE + KV-write kernel (kernel.rope_write_kv_triton) can rotate q [1, H, T, D] with these
    tables: an even D rotated as a whole (half 0 or D // 2), cos and sin in q's dtype and one row per token shared
    by every head (broadcastable to [1, 1, T, D]). The torch executor asks before folding RoPE into the call
    (trtopt_ops.paged_attention_rope), once per layer; the kernel refuses anything else. A function of shapes and
    dtypes, so the answer is cached by them (the checks themselves cost ~4 µs of host time a call)."""
    return _tables_fit(q.shape, cos.shape, sin.shape, q.dtype, cos.dtype, sin.dtype, half)


@functools.lru_cache(maxsize=1024)
def _tables_fit(q_shape, cos_shape, sin_shape, q_dtype, cos_dtype, sin_dtype, half: int) -> bool:
    if len(q_shape) != 4:
        return False
    T, D = q_shape[2], q_shape[3]
    return (D % 2 == 0 and half in (0, D // 2) and cos_dtype == sin_dtype == q_dtype
            and broadcasts_to(cos_shape, (1, 1, T, D)) and broadcasts_to(sin_shape, (1, 1, T, D)))


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """torch.broadcast_shapes(shape, target) == target, without its cost (~10-30 µs of host time per call, which the
    eager per-layer launch path pays): every trailing dim of shape is 1 or target's, and shape has no more dims."""
    return len(shape) <= len(target) and all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def copy_blocks_ref(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy whole blocks src → dst in every layer's pool, in place (copy-on-write).

    pairs: int64 [P, 2] of (src, dst). All sources are read before any destination is written.
    """
    if pairs.numel() == 0:
        return
    assert pairs.ndim == 2 and pairs.shape[1] == 2, f"pairs must be [P, 2] (src, dst), got {tuple(pairs.shape)}"
    for cache in kv_caches:
        src = pairs[:, 0].to(device=cache.device, dtype=torch.long)
        dst = pairs[:, 1].to(device=cache.device, dtype=torch.long)
        if cache.dtype == FP8_POOL_DTYPE:
            cache = cache.view(torch.uint8)  # a byte copy: not every index op is implemented for float8
        cache[dst] = cache[src]  # the gather on the right materialises every source first
