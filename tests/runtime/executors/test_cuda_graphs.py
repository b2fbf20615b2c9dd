"""Decode CUDA graphs: bucketing and padding are checked on CPU; capture/replay only on a GPU (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from paged_driver import BlockSource, Seq, make_step
from trtopt.build.plan import read_plan
from trtopt.runtime.executors.cuda_graphs import decode_buckets, dummy_decode_step, is_decode_step, pad_decode_step
from trtopt.runtime.executors.torch_executor import TorchExecutor


def test_buckets_cover_every_batch_size():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(12) == (1, 2, 4, 8, 12)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    buckets = decode_buckets(256)
    assert buckets[-1] == 256 and len(buckets) == 20
    for n in range(1, 257):  # every batch size has a bucket, padded by fewer than 16 rows
        assert 0 <= min(b for b in buckets if b >= n) - n < 16


def test_graphs_are_on_by_default_only_for_torch_on_cuda():
    from trtopt.runtime.engine import default_cuda_graphs

    assert default_cuda_graphs("torch", "cuda") and default_cuda_graphs("torch", "cuda:1")
    assert not default_cuda_graphs("torch", "cpu") and not default_cuda_graphs("onnxruntime", "cuda")
    assert not default_cuda_graphs("tensorrt", "cuda")


def test_only_pure_decode_steps_are_graphable():
    source = BlockSource(16)
    decode = make_step([Seq([1, 2, 3], cached=2), Seq([4, 5], cached=1)], [1, 1], 16, source)
    assert is_decode_step(decode)
    mixed = make_step([Seq([1, 2, 3], cached=1), Seq([4, 5], cached=1)], [2, 1], 16, source)
    assert not is_decode_step(mixed)


def test_dummy_step_is_all_padding_rows():
    """What start-up capture runs equals the padding rows of a real padded step: no writes, null block only."""
    source = BlockSource(16)
    real = pad_decode_step(make_step([Seq([1, 2, 3], cached=2)], [1], 16, source), 4, 6)
    dummy = dummy_decode_step(4, 6)
    assert is_decode_step(dummy)
    for name in ("block_tables", "seq_lens", "slot_mapping"):
        torch.testing.assert_close(getattr(dummy, name)[1:], getattr(real, name)[1:])
    assert dummy.slot_mapping.eq(-1).all() and dummy.block_tables.eq(0).all()
    torch.testing.assert_close(dummy.query_start_loc, real.query_start_loc)
    torch.testing.assert_close(dummy.logits_indices, real.logits_indices)


def test_padded_decode_step_gives_the_same_logits_and_writes(plan_dir):
    """The dummy rows of a padded step change nothing: same logits for the real rows, same pools."""
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    bs = plan.limits.block_size
    runs = {}
    for padded in (False, True):
        ex = TorchExecutor(built, plan)
        ex.allocate_kv_cache(24)
        source = BlockSource(24)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7, 33)]
        ex.execute(make_step(seqs, [len(s.tokens) for s in seqs], bs, source))
        for s in seqs:
            s.tokens.append(9)
        step = make_step(seqs, [1, 1, 1], bs, source)
        if padded:
            step = pad_decode_step(step, 8, plan.max_blocks_per_seq)
            assert step.num_tokens == 8 and step.block_tables.shape == (8, plan.max_blocks_per_seq)
            assert step.slot_mapping[3:].eq(-1).all() and step.block_tables[3:].eq(0).all()
        runs[padded] = (ex.execute(step)[:3], [p[1:].clone() for p in ex.kv_caches])
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-5, rtol=0)
    # Block 0 (the null block) is nobody's data; elsewhere only matmul rounding differs (8 rows vs 3).
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_graph_replay_matches_eager_on_cuda(plan_dir):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    bs = plan.limits.block_size
    logits = {}
    for graphs in (False, True):
        ex = TorchExecutor(built, plan, device="cuda", cuda_graphs=graphs)
        ex.allocate_kv_cache(32)
        ex.capture_decode_graphs()  # every bucket at start-up (a no-op without graphs)
        if graphs:
            assert set(ex.decode_graphs._captured) == set(decode_buckets(plan.limits.max_num_seqs))
        source = BlockSource(32)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7, 33)]
        ex.execute(make_step(seqs, [len(s.tokens) for s in seqs], bs, source))
        rows = []
        for _ in range(5):  # decode steps: replayed from the graph of bucket 4
            for s in seqs:
                s.tokens.append(11)
            rows.append(ex.execute(make_step(seqs, [1, 1, 1], bs, source)).cpu())
        if graphs:
            assert ex.decode_graphs.enabled and 4 in ex.decode_graphs._captured
        logits[graphs] = torch.stack(rows)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=0)
