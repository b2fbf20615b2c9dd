"""InputBuilder: ScheduledBatch -> the packed §3 tensors (StepInputs) of one step."""

from __future__ import annotations

import numpy as np
import torch

from trtopt.runtime.batch import ScheduledBatch, StepInputs


class InputBuilder:
    def __init__(self, block_size: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq

    def build(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch. Block tables are as wide as the longest table this step (<= max_blocks_per_seq),
        padded with the null block 0. A sampling sequence with K draft tokens gets K+1 logits rows (its last
        committed token and each draft token). When no sequence samples, logits_indices holds one row (the last
        token) so that no executor sees an empty gather; the engine discards it. The rows of prompt_logprob_positions
        follow all sampling rows, sequence by sequence."""
        assert not batch.is_empty, "an empty batch has nothing to run"
        bs = self.block_size
        seqs = batch.seqs
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        width = max(len(s.block_ids) for s in seqs)
        assert width <= self.max_blocks_per_seq, f"a block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}"
        # Filled row by row in numpy: a per-row torch op costs ~5 us, which a 256-sequence decode step pays 256 times.
        tables = np.zeros((len(seqs), width), dtype=np.int32)  # [S, W], 0 = null block
        total = 0
        prompt_rows: list[int] = []
        for s, seq in enumerate(seqs):
            start, blocks = seq.start_pos, seq.block_ids
            tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
            n = len(tokens)
            end = start + n
            assert len(blocks) * bs >= end, f"{seq.request_id}: {len(blocks)} blocks for {end} tokens"
            input_ids += tokens
            if n == 1:  # a decode row: the common case, kept free of range objects
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            total += n
            qsl.append(total)
            seq_lens.append(end)
            if seq.samples:  # one row per draft token verified, plus the row after the last one
                logits_indices.extend(range(total - 1 - len(seq.spec_token_ids), total))
            if seq.prompt_logprob_positions:
                first = total - n - start  # the row of position 0
                prompt_rows.extend(first + p for p in seq.prompt_logprob_positions)
            tables[s, : len(blocks)] = blocks
        logits_indices += prompt_rows
        if not logits_indices:
            logits_indices.append(total - 1)
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.int64),  # [1, T]
            position_ids=torch.tensor([positions], dtype=torch.int64),  # [1, T]
            block_tables=torch.from_numpy(tables),  # [S, W]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [S]
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),  # [S+1]
            slot_mapping=torch.tensor(slots, dtype=torch.int64),  # [T]
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # [N]
        )
