import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.input_builder import InputBuilder


def test_packs_a_mixed_prefill_chunk_and_decode_batch_exactly():
    bs = 4
    batch = ScheduledBatch(
        seqs=[
            # decode: 1 new token at position 5 (block 3 offset 1)
            ScheduledSeq("a", token_ids=[42], start_pos=5, block_ids=[7, 3], samples=True),
            # prefill chunk: positions 2..6 of a longer prompt, does not sample
            ScheduledSeq("b", token_ids=[10, 11, 12, 13, 14], start_pos=2, block_ids=[1, 2], samples=False),
            # a whole 3-token prompt
            ScheduledSeq("c", token_ids=[20, 21, 22], start_pos=0, block_ids=[5], samples=True),
        ],
        num_batched_tokens=9,
        preempted_ids=[],
    )
    x = InputBuilder(bs, max_blocks_per_seq=8).build(batch)
    assert x.input_ids.tolist() == [[42, 10, 11, 12, 13, 14, 20, 21, 22]]
    assert x.position_ids.tolist() == [[5, 2, 3, 4, 5, 6, 0, 1, 2]]
    assert x.block_tables.tolist() == [[7, 3], [1, 2], [5, 0]]
    assert x.block_tables.dtype == torch.int32
    assert x.seq_lens.tolist() == [6, 7, 3]
    assert x.query_start_loc.tolist() == [0, 1, 6, 9]
    assert x.slot_mapping.tolist() == [3 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 20, 21, 22]
    assert x.logits_indices.tolist() == [0, 8]
    assert (x.num_tokens, x.num_seqs) == (9, 3)


def test_a_step_with_no_sampling_still_requests_one_logits_row():
    batch = ScheduledBatch([ScheduledSeq("b", [1, 2, 3], 0, [1], samples=False)], 3, [])
    assert InputBuilder(4, 8).build(batch).logits_indices.tolist() == [2]


def _reference(batch: ScheduledBatch, bs: int) -> dict[str, list]:
    """The §3 tensors of a batch written out token by token."""
    ids, pos, slots, qsl, lens, rows, prompt_rows = [], [], [], [0], [], [], []
    width = max(len(s.block_ids) for s in batch.seqs)
    for s in batch.seqs:
        row0 = len(ids) - s.start_pos  # the row position 0 would have
        for i, t in enumerate(s.token_ids + s.spec_token_ids):
            p = s.start_pos + i
            ids.append(t)
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        qsl.append(len(ids))
        lens.append(s.start_pos + len(s.token_ids) + len(s.spec_token_ids))
        if s.samples:
            rows += [len(ids) - 1 - k for k in range(len(s.spec_token_ids), -1, -1)]
        prompt_rows += [row0 + p for p in s.prompt_logprob_positions]
    return {"input_ids": [ids], "position_ids": [pos], "slot_mapping": slots, "query_start_loc": qsl,
            "seq_lens": lens, "logits_indices": rows + prompt_rows or [len(ids) - 1],
            "block_tables": [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in batch.seqs]}


ROW = st.tuples(st.integers(0, 70), st.integers(1, 5), st.integers(0, 3), st.booleans(), st.integers(0, 3), st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(st.lists(ROW, min_size=1, max_size=12), st.sampled_from([1, 4, 16]), st.sampled_from(["decode", "mixed", "extras"]))
def test_every_batch_packs_as_written_out_token_by_token(rows, bs, kind):
    """Decode rows, prefill chunks, draft tokens (speculative verification) and prompt-logprob rows, in any mix:
    build's numpy packing equals the reference written out token by token."""
    seqs, next_block = [], 1
    for k, (start, n, spare, samples, drafts, wanted) in enumerate(rows):
        if kind == "decode":
            n, samples = 1, True
        drafts = drafts if kind == "extras" and samples else 0
        positions = range(start, start + min(wanted, n)) if kind == "extras" else range(0)
        num_blocks = -(-(start + n + drafts) // bs) + spare
        blocks = list(range(next_block, next_block + num_blocks))[::-1]  # any ids, in any order
        next_block += num_blocks
        seqs.append(ScheduledSeq(f"r{k}", [100 + k * 10 + i for i in range(n)], start, blocks, samples=samples,
                                 num_lookahead=drafts, spec_token_ids=[7] * drafts, prompt_logprob_positions=positions))
    batch = ScheduledBatch(seqs, sum(len(s.token_ids) for s in seqs), [])
    x = InputBuilder(bs, max_blocks_per_seq=80).build(batch)
    got = {name: getattr(x, name).tolist() for name in _reference(batch, bs)}
    assert got == _reference(batch, bs)
    assert x.block_tables.dtype == x.seq_lens.dtype == x.query_start_loc.dtype == torch.int32
    assert x.input_ids.dtype == x.position_ids.dtype == x.slot_mapping.dtype == x.logits_indices.dtype == torch.int64


def test_block_tables_are_reused_only_while_the_list_is_the_same():
    """A table converted once is reused for the same list object; a new list (a block was added) is read anew."""
    builder = InputBuilder(4, 8)
    table = [3, 5]
    first = builder.build(ScheduledBatch([ScheduledSeq("a", [1], 5, table, samples=True)], 1, []))
    again = builder.build(ScheduledBatch([ScheduledSeq("a", [2], 6, table, samples=True)], 1, []))
    grown = builder.build(ScheduledBatch([ScheduledSeq("a", [3], 8, [3, 5, 9], samples=True)], 1, []))
    assert first.block_tables.tolist() == again.block_tables.tolist() == [[3, 5]]
    assert grown.block_tables.tolist() == [[3, 5, 9]] and grown.slot_mapping.tolist() == [9 * 4]
    assert set(builder._rows) == {"a"}
    builder.build(ScheduledBatch([ScheduledSeq("b", [4], 0, [2], samples=True)], 1, []))
    assert set(builder._rows) == {"b"}, "a sequence not in the step is forgotten"


def test_a_decode_row_whose_table_misses_its_token_is_refused():
    batch = ScheduledBatch([ScheduledSeq("a", [1], 3, [5], samples=True), ScheduledSeq("b", [2], 4, [6], samples=True)], 2, [])
    with pytest.raises(AssertionError, match="b: 1 blocks for 5 tokens"):
        InputBuilder(4, 8).build(batch)
