"""A minimal packed paged-KV driver, independent of the runtime's scheduler and block manager.

It is what `trtopt check` and the executor tests feed every backend: blocks are handed out by hand in reverse order
(so logical and physical order differ; block 0 is the null block), and each step packs any mix of prefill chunks
and decode tokens of several sequences into one ``StepInputs`` (the paged signature, trtopt/signature.py).
"""

from __future__ import annotations

import dataclasses

import torch

from trtopt.runtime.batch import StepInputs


@dataclasses.dataclass
class Seq:
    """One sequence as the driver tracks it."""

    tokens: list[int]  # prompt + generated
    cached: int = 0  # tokens already in the KV cache
    blocks: list[int] = dataclasses.field(default_factory=list)  # physical block ids in logical order


class BlockSource:
    """Hands out blocks 1..num_blocks-1 in ascending order (block 0 is the null block)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, 0, -1))

    def take(self) -> int:
        assert self.free, "the driver ran out of KV blocks; give the executors more num_blocks"
        return self.free.pop()


def blocks_needed(prompt_lens: list[int], new_tokens: int, block_size: int) -> int:
    """Pool size for these sequences each growing by ``new_tokens``: their blocks plus the null block."""
    return 1 + sum(-(-(n + new_tokens) // block_size) for n in prompt_lens)


def make_step(seqs: list[Seq], counts: list[int], block_size: int, blocks: BlockSource, *,
              every_row: bool = False) -> StepInputs:
    """Schedule ``counts[s]`` uncached tokens of each sequence (advancing ``cached``, taking blocks as needed).

    Logits are asked for each sequence's last scheduled row, or for every scheduled row with ``every_row``.
    """
    ids, pos, slots, qsl, lens, rows = [], [], [], [0], [], []
    for seq, n in zip(seqs, counts):
        start, end = seq.cached, seq.cached + n
        while len(seq.blocks) * block_size < end:
            seq.blocks.append(blocks.take())
        for p in range(start, end):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // block_size] * block_size + p % block_size)
        rows.extend(range(qsl[-1], qsl[-1] + n) if every_row else [qsl[-1] + n - 1])
        qsl.append(qsl[-1] + n)
        lens.append(end)
        seq.cached = end
    width = max(len(s.blocks) for s in seqs)
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
    return StepInputs(
        input_ids=torch.tensor([ids], dtype=torch.int64),
        position_ids=torch.tensor([pos], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(rows, dtype=torch.int64),
    )


def packed_schedule(prompt_lens: list[int], *, chunk: int, decode_steps: int) -> list[list[int]]:
    """Per step, new tokens per sequence: sequence 0's prompt in chunks of ``chunk`` while the others prefill
    whole and then decode, so prefill chunks and decode rows share steps; then ``decode_steps`` all-decode steps."""
    pending = list(prompt_lens)
    steps = []
    while any(pending):
        counts = [min(n, chunk) if i == 0 else (n if n else 1) for i, n in enumerate(pending)]
        steps.append(counts)
        pending = [max(0, n - c) if n else 0 for n, c in zip(pending, counts)]
    return steps + [[1] * len(prompt_lens) for _ in range(decode_steps)]
