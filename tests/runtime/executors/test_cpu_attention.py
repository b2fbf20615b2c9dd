"""The CPU PagedAttention path of the torch executor against the torch reference, over many packed steps."""

from __future__ import annotations

import random
import unittest.mock

import pytest
import torch

from trtopt.plugins.paged_attention.reference import paged_attention_ref
from trtopt.plugins.paged_attention import cpu as cpu_attention
from trtopt.plugins.paged_attention.cpu import paged_attention_cpu


def random_step(rng: random.Random, *, num_seqs: int, decode_only: bool, block_size: int, num_blocks: int,
                hkv: int, d: int, dtype: torch.dtype):
    """A packed step: per sequence a cached context and n new tokens, blocks scattered over the pool."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    news, lens, tables, slots = [], [], [], []
    for _ in range(num_seqs):
        n = 1 if decode_only else rng.choice([1, 1, 2, 5, 17])
        cached = rng.choice([0, 3, 16, 40]) if n > 1 else rng.randint(0, 50)
        total = cached + n
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        news.append(n)
        lens.append(total)
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
    width = max(len(t) for t in tables)
    block_tables = torch.zeros((num_seqs, width), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.tensor([0] + [sum(news[: i + 1]) for i in range(num_seqs)], dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    if len(slots) > 2:
        slot_mapping[rng.randrange(len(slots))] = -1  # a token whose K/V is not written
    cache = torch.randn((num_blocks, 2, hkv, block_size, d)).to(dtype)
    return block_tables, torch.tensor(lens, dtype=torch.int32), qsl, slot_mapping, cache


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference(group, decode_only, dtype):
    rng = random.Random(group * 10 + decode_only)
    hkv, d, block_size = 2, 32, 16
    hq = hkv * group
    for num_seqs in (1, 3, 7):
        tables, lens, qsl, slots, cache = random_step(rng, num_seqs=num_seqs, decode_only=decode_only,
                                                      block_size=block_size, num_blocks=64, hkv=hkv, d=d, dtype=dtype)
        T = int(qsl[-1])
        q = torch.randn((1, hq, T, d)).to(dtype)
        k = torch.randn((1, hkv, T, d)).to(dtype)
        v = torch.randn((1, hkv, T, d)).to(dtype)
        # Plans always wire alibi_slopes; zeros mean "no ALiBi" and must take the fast path.
        attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5, alibi_slopes=torch.zeros(hq))
        ref_cache = cache.clone()
        expected, _ = paged_attention_ref(q, k, v, ref_cache, tables, lens, qsl, slots, **attrs)
        with unittest.mock.patch("trtopt.plugins.paged_attention.cpu.paged_attention_ref",
                                 side_effect=AssertionError("fell back to the reference")):
            got, returned = paged_attention_cpu(q, k, v, cache, tables, lens, qsl, slots, **attrs)
        assert returned is cache
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


def test_window_and_alibi_fall_back_to_reference():
    rng = random.Random(7)
    tables, lens, qsl, slots, cache = random_step(rng, num_seqs=3, decode_only=False, block_size=16, num_blocks=32,
                                                  hkv=2, d=16, dtype=torch.float32)
    T = int(qsl[-1])
    q, k, v = torch.randn((1, 4, T, 16)), torch.randn((1, 2, T, 16)), torch.randn((1, 2, T, 16))
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=5,
                 alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    expected, _ = paged_attention_ref(q, k, v, cache.clone(), tables, lens, qsl, slots, **attrs)
    got, _ = paged_attention_cpu(q, k, v, cache, tables, lens, qsl, slots, **attrs)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("lens,batched", [([40, 33, 47], True), ([900, 3, 5, 2], False)])
def test_uneven_decode_contexts_use_per_sequence_attention(lens, batched):
    """One long context among short ones: the batched gather would be mostly padding, so each sequence runs alone.
    Both paths must give the reference's numbers."""
    block_size, hkv, d, hq = 16, 2, 16, 4
    tables = torch.zeros((len(lens), -(-max(lens) // block_size)), dtype=torch.int32)
    next_block = 1
    for s, n in enumerate(lens):
        blocks = -(-n // block_size)
        tables[s, :blocks] = torch.arange(next_block, next_block + blocks, dtype=torch.int32)
        next_block += blocks
    cache = torch.randn((next_block, 2, hkv, block_size, d))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    slots = torch.tensor([int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for s, n in enumerate(lens)])
    q, k, v = torch.randn((1, hq, len(lens), d)), torch.randn((1, hkv, len(lens), d)), torch.randn((1, hkv, len(lens), d))
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=0.25)
    expected, _ = paged_attention_ref(q, k, v, cache.clone(), tables, seq_lens, qsl, slots, **attrs)
    with unittest.mock.patch.object(cpu_attention, "_decode", wraps=cpu_attention._decode) as decode:
        got, _ = paged_attention_cpu(q, k, v, cache, tables, seq_lens, qsl, slots, **attrs)
    assert decode.called == batched
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
