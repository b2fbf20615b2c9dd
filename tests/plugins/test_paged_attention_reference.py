"""paged_attention_ref against an independent per-token loop, over many shapes and batch mixes."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtopt.plugins.paged_attention.reference import copy_blocks_ref, paged_attention_ref


def make_step(
    rng: random.Random,
    *,
    context_lens: list[int],
    new_tokens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    skip_slots: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A random step: a pool whose blocks are shuffled across sequences, old tokens already cached, new q/k/v.

    context_lens[s] is seq_lens[s] (after the step); new_tokens[s] of them are new this step. ``skip_slots`` new
    tokens get slot −1 (their K/V are then written by hand beforehand, as if an earlier step had cached them).
    """
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + rng.randrange(0, 2)  # sometimes a padded column
    num_blocks = 1 + sum(blocks_per_seq) + rng.randrange(0, 3)  # + the null block + some spare
    physical = list(range(1, num_blocks))
    rng.shuffle(physical)
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = torch.tensor([physical.pop() for _ in range(nb)], dtype=torch.int32)

    kv_cache = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    total = sum(new_tokens)
    q = torch.randn(1, num_heads, total, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, num_kv_heads, total, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, num_kv_heads, total, head_dim, generator=gen).to(dtype)

    slots = []
    for s, (ctx, n) in enumerate(zip(context_lens, new_tokens)):
        for pos in range(ctx - n, ctx):
            slots.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    for t in rng.sample(range(total), min(skip_slots, total)):
        slot = int(slot_mapping[t])
        kv_cache[slot // block_size, 0, :, slot % block_size] = k[0, :, t]
        kv_cache[slot // block_size, 1, :, slot % block_size] = v[0, :, t]
        slot_mapping[t] = -1

    query_start_loc = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0).tolist()), dtype=torch.int32)
    return dict(
        q=q, k=k, v=v, kv_cache=kv_cache, block_tables=block_tables,
        seq_lens=torch.tensor(context_lens, dtype=torch.int32), query_start_loc=query_start_loc,
        slot_mapping=slot_mapping,
    )


def naive_paged_attention(step: dict, *, scale: float, causal: int, sliding_window: int, alibi_slopes):
    """One token, one head at a time, straight from the contract's wording (a different code path on purpose)."""
    q, k, v = step["q"].double(), step["k"].double(), step["v"].double()
    pool = step["kv_cache"].clone()
    block_size = pool.shape[3]
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    for t, slot in enumerate(step["slot_mapping"].tolist()):
        if slot != -1:
            pool[slot // block_size, 0, :, slot % block_size, :] = step["k"][0, :, t, :]
            pool[slot // block_size, 1, :, slot % block_size, :] = step["v"][0, :, t, :]

    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = step["query_start_loc"].tolist()
    for s, seq_len in enumerate(step["seq_lens"].tolist()):
        n = qsl[s + 1] - qsl[s]
        for j in range(n):
            t, p = qsl[s] + j, seq_len - n + j
            key_positions = [kp for kp in range(seq_len) if (not causal or kp <= p)]
            if sliding_window > 0:
                key_positions = [kp for kp in key_positions if kp > p - sliding_window]
            for h in range(num_heads):
                kv_head = h // (num_heads // num_kv_heads)
                scores, vals = [], []
                for kp in key_positions:
                    block = int(step["block_tables"][s, kp // block_size])
                    key = pool[block, 0, kv_head, kp % block_size].double()
                    score = float(q[0, h, t] @ key) * scale
                    if alibi_slopes is not None:
                        score += float(alibi_slopes[h]) * (kp - p)
                    scores.append(score)
                    vals.append(pool[block, 1, kv_head, kp % block_size].double())
                weights = torch.tensor(scores, dtype=torch.float64).softmax(0)
                out[0, h, t] = (weights[:, None] * torch.stack(vals)).sum(0)
    return out, pool


def run_both(step: dict, *, num_heads, num_kv_heads, causal=1, sliding_window=0, alibi=False, rng=None):
    head_dim = step["q"].shape[3]
    scale = 1.0 / math.sqrt(head_dim)
    slopes = None
    if alibi:
        slopes = torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)
    expected, expected_pool = naive_paged_attention(
        step, scale=scale, causal=causal, sliding_window=sliding_window, alibi_slopes=slopes
    )
    pool = step["kv_cache"].clone()
    out, returned_pool = paged_attention_ref(
        step["q"], step["k"], step["v"], pool, step["block_tables"], step["seq_lens"],
        step["query_start_loc"], step["slot_mapping"], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, scale=scale, causal=causal, sliding_window=sliding_window, alibi_slopes=slopes,
    )
    assert returned_pool is pool, "the pool must be written in place and returned (executors alias it)"
    return out, pool, expected, expected_pool


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)])  # GQA 1/2/3/4/8
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_naive(num_heads, num_kv_heads, block_size):
    rng = random.Random(num_heads * 100 + num_kv_heads * 10 + block_size)
    # A full prefill, a chunked-prefill continuation, two decodes and a speculative 3-token verify, in one step.
    context_lens = [23, 57, 1, 40, 35]
    new_tokens = [23, 19, 1, 1, 3]
    step = make_step(rng, context_lens=context_lens, new_tokens=new_tokens, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=16, block_size=block_size)
    out, pool, expected, expected_pool = run_both(step, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool.to(pool.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("sliding_window", [1, 5, 16])
@pytest.mark.parametrize("alibi", [False, True])
def test_sliding_window_and_alibi(sliding_window, alibi):
    rng = random.Random(sliding_window * 2 + alibi)
    step = make_step(rng, context_lens=[30, 9, 50], new_tokens=[30, 2, 1], num_heads=6, num_kv_heads=2,
                     head_dim=8, block_size=16)
    out, _, expected, _ = run_both(step, num_heads=6, num_kv_heads=2, sliding_window=sliding_window, alibi=alibi)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_skipped_slots_are_not_written_and_still_attended():
    rng = random.Random(7)
    step = make_step(rng, context_lens=[20, 33], new_tokens=[20, 4], num_heads=4, num_kv_heads=2,
                     head_dim=8, block_size=16, skip_slots=5)
    null_block_before = step["kv_cache"][0].clone()
    out, pool, expected, expected_pool = run_both(step, num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)
    assert torch.equal(pool[0], null_block_before), "the null block must never be written by the reference"


def test_non_causal_sees_the_whole_context():
    rng = random.Random(3)
    step = make_step(rng, context_lens=[12, 20], new_tokens=[12, 5], num_heads=2, num_kv_heads=1,
                     head_dim=8, block_size=16)
    out, _, expected, _ = run_both(step, num_heads=2, num_kv_heads=1, causal=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_fp16_accumulates_in_fp32_and_returns_fp16():
    rng = random.Random(11)
    step = make_step(rng, context_lens=[40, 7], new_tokens=[8, 1], num_heads=4, num_kv_heads=2,
                     head_dim=32, block_size=16, dtype=torch.float16)
    out, pool, expected, expected_pool = run_both(step, num_heads=4, num_kv_heads=2)
    assert out.dtype == torch.float16 and pool.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)


def test_empty_sequence_rows_are_allowed():
    # A sequence with no new tokens this step (qsl repeats) owns no rows and must not shift the others.
    rng = random.Random(5)
    step = make_step(rng, context_lens=[10, 10, 18], new_tokens=[3, 1, 2], num_heads=2, num_kv_heads=2,
                     head_dim=8, block_size=16)
    step["query_start_loc"] = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    step["seq_lens"] = torch.tensor([10, 9, 18], dtype=torch.int32)
    step["q"], step["k"], step["v"] = (x[:, :, [0, 1, 2, 4, 5]] for x in (step["q"], step["k"], step["v"]))
    step["slot_mapping"] = step["slot_mapping"][[0, 1, 2, 4, 5]]
    out, _, expected, _ = run_both(step, num_heads=2, num_kv_heads=2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    num_kv_heads=st.integers(1, 2),
    block_size=st.sampled_from([16, 32]),
    sliding_window=st.sampled_from([0, 0, 3, 17]),
    alibi=st.booleans(),
    causal=st.sampled_from([1, 1, 0]),
)
def test_property_random_batches(data, group, num_kv_heads, block_size, sliding_window, alibi, causal):
    num_seqs = data.draw(st.integers(1, 4))
    context_lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    new_tokens = [data.draw(st.integers(1, min(c, 12))) for c in context_lens]
    skip = data.draw(st.integers(0, 2))
    rng = random.Random(data.draw(st.integers(0, 10_000)))
    num_heads = group * num_kv_heads
    step = make_step(rng, context_lens=context_lens, new_tokens=new_tokens, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=4, block_size=block_size, skip_slots=skip)
    out, pool, expected, expected_pool = run_both(step, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                  causal=causal, sliding_window=sliding_window, alibi=alibi)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)


def test_copy_blocks_copies_every_layer_reading_sources_first():
    caches = [torch.randn(6, 2, 2, 4, 3) for _ in range(3)]
    before = [c.clone() for c in caches]
    # 1→2 and 2→3 in one call: block 3 must receive block 2's OLD contents.
    copy_blocks_ref(caches, torch.tensor([[1, 2], [2, 3], [4, 5]], dtype=torch.int64))
    for cache, old in zip(caches, before):
        assert torch.equal(cache[2], old[1]) and torch.equal(cache[3], old[2]) and torch.equal(cache[5], old[4])
        assert torch.equal(cache[[0, 1, 4]], old[[0, 1, 4]])
    copy_blocks_ref(caches, torch.zeros(0, 2, dtype=torch.int64))  # nothing to copy is fine


def test_rope_tables_fit_answers_by_shape_and_dtype():
    """The answer is cached by shapes and dtypes (plugins/paged_attention/reference.py): each of them must still
    change it."""
    from trtopt.plugins.paged_attention.reference import rope_tables_fit

    q = torch.zeros(1, 4, 3, 8, dtype=torch.bfloat16)
    row, per_token = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16)
    assert rope_tables_fit(q, row, row) and rope_tables_fit(q, per_token, per_token)
    assert rope_tables_fit(q, row, row, half=4) and not rope_tables_fit(q, row, row, half=3)
    assert not rope_tables_fit(q, row.float(), row.float())  # not q's dtype
    assert not rope_tables_fit(q, row, row.float())  # cos and sin differ
    assert not rope_tables_fit(q, torch.zeros(2, 8, dtype=torch.bfloat16), row)  # 2 rows for 3 tokens
    assert not rope_tables_fit(q, torch.zeros(1, 4, 3, 8, dtype=torch.bfloat16), row)  # one row per head
    assert not rope_tables_fit(q[0], row, row)  # q is not [1, H, T, D]
    assert not rope_tables_fit(torch.zeros(1, 4, 3, 7, dtype=torch.bfloat16), row[..., :7], row[..., :7])  # odd D
