import torch

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
