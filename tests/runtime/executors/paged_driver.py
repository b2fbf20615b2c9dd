"""A minimal paged-KV driver for executor tests, independent of trtopt.runtime's scheduler and block manager.

Blocks are handed out by hand in reverse order (so logical and physical order differ; block 0 is the null block),
and each step packs any mix of prefill chunks and decode tokens of several sequences. The expected logits come
from the ORIGINAL export run on onnxruntime one sequence at a time with past KV.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import torch

from trtopt.runtime.batch import StepInputs


@dataclasses.dataclass
class Seq:
    tokens: list[int]  # prompt + generated
    cached: int = 0  # tokens already in the KV cache
    blocks: list[int] = dataclasses.field(default_factory=list)


class BlockSource:
    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, 0, -1))

    def take(self) -> int:
        return self.free.pop()


def make_step(seqs: list[Seq], counts: list[int], block_size: int, blocks: BlockSource) -> StepInputs:
    """Schedule counts[s] uncached tokens of each sequence; logits for each sequence's last scheduled row."""
    ids, pos, slots, qsl, lens, last = [], [], [], [0], [], []
    for seq, n in zip(seqs, counts):
        start, end = seq.cached, seq.cached + n
        while len(seq.blocks) * block_size < end:
            seq.blocks.append(blocks.take())
        for p in range(start, end):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(end)
        last.append(qsl[-1] - 1)
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
        logits_indices=torch.tensor(last, dtype=torch.int64),
    )


class OriginalModel:
    """The original export with past KV, batch 1, one sequence at a time."""

    def __init__(self, onnx_path, num_kv_heads: int, head_dim: int):
        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.sess.get_inputs()}
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.past_names = sorted(n for n in self.inputs if n.startswith("past_key_values"))
        self.empty = np.zeros((1, num_kv_heads, 0, head_dim), np.float32)

    def new_state(self) -> dict[str, np.ndarray]:
        return {n: self.empty for n in self.past_names}

    def step(self, past: dict, tokens: list[int], start: int) -> tuple[np.ndarray, dict]:
        n = len(tokens)
        feeds = {"input_ids": np.array([tokens], np.int64), "position_ids": np.arange(start, start + n)[None]}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, start + n), np.int64)
        by_name = dict(zip(self.outputs, self.sess.run(None, {**feeds, **past})))
        new_past = {p: by_name[p.replace("past_key_values", "present")] for p in self.past_names}
        return by_name["logits"][0, -1], new_past


def packed_schedule(prompt_lens: list[int], *, chunk: int, decode_steps: int) -> list[list[int]]:
    """Per step, new tokens per sequence: sequence 0's prompt in chunks of `chunk` while the others prefill
    whole and then decode, so prefill chunks and decode rows share steps; then `decode_steps` all-decode steps."""
    pending = list(prompt_lens)
    steps = []
    while any(pending):
        counts = [min(n, chunk) if i == 0 else (n if n else 1) for i, n in enumerate(pending)]
        steps.append(counts)
        pending = [max(0, n - c) if n else 0 for n, c in zip(pending, counts)]
    return steps + [[1] * len(prompt_lens) for _ in range(decode_steps)]
