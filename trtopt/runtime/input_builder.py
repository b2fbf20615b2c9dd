"""InputBuilder: ScheduledBatch -> the packed §3 tensors (StepInputs) of one step."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq, StepInputs


class InputBuilder:
    def __init__(self, block_size: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # request id -> (the block-id list KVCacheManager handed out, the same ids as int32 numpy): _block_tables.
        self._rows: dict[str, tuple[list[int], np.ndarray]] = {}

    def build(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch. Block tables are as wide as the longest table this step (<= max_blocks_per_seq),
        padded with the null block 0. A sampling sequence with K draft tokens gets K+1 logits rows (its last
        committed token and each draft token). When no sequence samples, logits_indices holds one row (the last
        token) so that no executor sees an empty gather; the engine discards it. The rows of prompt_logprob_positions
        follow all sampling rows, sequence by sequence.

        One pass over the sequences collects what only Python knows (their tokens, starts, lengths); every
        per-token tensor is then computed in numpy for the whole step. Per token in Python (and through
        torch.tensor of lists, ~50 ns an element) an 8192-token prefill step cost ~1.3 ms of host time."""
        assert not batch.is_empty, "an empty batch has nothing to run"
        bs = self.block_size
        seqs = batch.seqs
        tables_t, num_blocks = self._block_tables(seqs)
        tables = tables_t.numpy()
        num_seqs = len(seqs)
        token_lists = [s.token_ids + s.spec_token_ids if s.spec_token_ids else s.token_ids for s in seqs]
        counts = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
        ends = starts + counts
        if (num_blocks * bs < ends).any():
            k = int(np.flatnonzero(num_blocks * bs < ends)[0])
            raise AssertionError(f"{seqs[k].request_id}: {num_blocks[k]} blocks for {ends[k]} tokens")
        total = int(counts.sum())
        if total == num_seqs:  # one row per sequence (decode): no per-token expansion needed
            qsl = np.arange(num_seqs + 1, dtype=np.int64)
            row_seq, positions = qsl[:-1], starts
        else:
            qsl = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(counts, out=qsl[1:])
            row_seq = np.repeat(np.arange(num_seqs), counts)  # the sequence of each token row
            positions = np.arange(total) + np.repeat(starts - qsl[:-1], counts)
        input_ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
        slots = tables[row_seq, positions // bs].astype(np.int64) * bs + positions % bs
        logits_indices = self._logits_rows(seqs, qsl)
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).unsqueeze(0),  # [1, T]
            position_ids=torch.from_numpy(positions).unsqueeze(0),  # [1, T]
            block_tables=tables_t,  # [S, W]
            seq_lens=torch.from_numpy(ends.astype(np.int32)),  # [S]
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),  # [S+1]
            slot_mapping=torch.from_numpy(slots),  # [T]
            logits_indices=torch.from_numpy(logits_indices),  # [N]
        )

    @staticmethod
    def _logits_rows(seqs: list[ScheduledSeq], qsl: np.ndarray) -> np.ndarray:
        """int64 [N]: the last row of each sampling sequence (and the rows of its draft tokens before it), then
        the prompt-logprob rows, sequence by sequence; one row (the last token) when nothing is wanted."""
        samples = np.fromiter((s.samples for s in seqs), dtype=bool, count=len(seqs))
        if any(s.spec_token_ids for s in seqs):
            rows = np.array([r for k, s in enumerate(seqs) if s.samples
                             for r in range(int(qsl[k + 1]) - 1 - len(s.spec_token_ids), int(qsl[k + 1]))], dtype=np.int64)
        else:
            rows = qsl[1:][samples] - 1
        prompt_rows = [int(qsl[k]) - s.start_pos + p for k, s in enumerate(seqs) if s.prompt_logprob_positions
                       for p in s.prompt_logprob_positions]  # qsl[k] - start is the row of position 0
        if prompt_rows:
            rows = np.concatenate([rows, np.array(prompt_rows, dtype=np.int64)])
        if not len(rows):
            rows = qsl[-1:] - 1
        return np.ascontiguousarray(rows, dtype=np.int64)

    def _block_tables(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, np.ndarray]:
        """int32 [S, W]: each sequence's block ids, padded with the null block 0 to the widest table W; and each
        sequence's number of blocks.

        A sequence's table is converted to numpy once and reused while KVCacheManager hands out the same list
        (it never mutates a list it handed out: every change makes a new one), so a decode step converts only
        the tables that gained a block; the rows are then joined and scattered in two numpy calls. Per row in
        Python this cost ~1 µs a sequence, 0.3 ms of a 256-sequence step (benchmarks/bench_host_step.py)."""
        known, kept = self._rows, {}
        rows = []
        for seq in seqs:
            row = known.get(seq.request_id)
            if row is None or row[0] is not seq.block_ids:
                row = (seq.block_ids, np.array(seq.block_ids, dtype=np.int32))
            kept[seq.request_id] = row
            rows.append(row[1])
        self._rows = kept  # the tables of this step's sequences only: finished ones are dropped here
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        width = int(lens.max())
        assert width <= self.max_blocks_per_seq, f"a block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}"
        if int(lens.min()) == width:  # no padding (always so for one sequence)
            tables = np.concatenate(rows).reshape(len(rows), width)
        else:
            tables = np.zeros((len(rows), width), dtype=np.int32)
            tables[np.arange(width) < lens[:, None]] = np.concatenate(rows)  # row-major: row s gets its own ids, in order
        return torch.from_numpy(tables), lens
