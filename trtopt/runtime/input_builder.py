"""InputBuilder: ScheduledBatch -> the packed §3 tensors (StepInputs) of one step."""

from __future__ import annotations

import torch

from trtopt.runtime.batch import ScheduledBatch, StepInputs


class InputBuilder:
    def __init__(self, block_size: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq

    def build(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch. Block tables are as wide as the longest table this step (<= max_blocks_per_seq),
        padded with the null block 0. When no sequence samples, logits_indices holds one row (the last
        token) so that no executor sees an empty gather; the engine discards it."""
        assert not batch.is_empty, "an empty batch has nothing to run"
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        width = max(len(s.block_ids) for s in batch.seqs)
        assert width <= self.max_blocks_per_seq, f"a block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}"
        tables = torch.zeros(len(batch.seqs), width, dtype=torch.int32)  # [S, W], 0 = null block
        for s, seq in enumerate(batch.seqs):
            end = seq.start_pos + seq.num_new_tokens
            assert len(seq.block_ids) * bs >= end, f"{seq.request_id}: {len(seq.block_ids)} blocks for {end} tokens"
            input_ids += seq.token_ids
            positions += range(seq.start_pos, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(seq.start_pos, end)]
            qsl.append(qsl[-1] + seq.num_new_tokens)
            seq_lens.append(end)
            if seq.samples:
                logits_indices.append(qsl[-1] - 1)
            tables[s, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        if not logits_indices:
            logits_indices.append(qsl[-1] - 1)
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.int64),  # [1, T]
            position_ids=torch.tensor([positions], dtype=torch.int64),  # [1, T]
            block_tables=tables,  # [S, W]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [S]
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),  # [S+1]
            slot_mapping=torch.tensor(slots, dtype=torch.int64),  # [T]
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # [N]
        )
