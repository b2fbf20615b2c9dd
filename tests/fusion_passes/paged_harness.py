"""A tiny paged-KV driver for checking plan graphs on onnxruntime against the original graph with past KV.

Independent of trtopt.runtime on purpose: it lays out blocks by hand (block 0 is the null block), so a bug in the
runtime cannot hide a bug in the fused graph or the other way round.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort


@dataclasses.dataclass
class Seq:
    tokens: list[int]  # every token so far (prompt + generated)
    cached: int = 0  # how many of them are in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)


def session(model_bytes_or_path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(model_bytes_or_path, opts, providers=["CPUExecutionProvider"])


class PagedRunner:
    """Runs the fused graph one packed step at a time."""

    def __init__(
        self,
        sess: ort.InferenceSession,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int = 32,
        dtype=np.float32,
    ):
        self.sess = sess
        self.block_size = block_size
        self.caches = [np.zeros((num_blocks, 2, num_kv_heads, block_size, head_dim), dtype) for _ in range(num_layers)]
        self.next_block = 1  # block 0 is the null block
        # Give out blocks in reverse order so logical and physical order differ.
        self.free = list(range(num_blocks - 1, 0, -1))

    def step(self, seqs: list[Seq], new_counts: list[int]) -> np.ndarray:
        """Schedule new_counts[s] uncached tokens of each sequence; returns logits of each one's last row."""
        ids, pos, slots, qsl, lens, last = [], [], [], [0], [], []
        for seq, n in zip(seqs, new_counts):
            start, end = seq.cached, seq.cached + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            for p in range(start, end):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // self.block_size] * self.block_size + p % self.block_size)
            qsl.append(qsl[-1] + n)
            lens.append(end)
            last.append(qsl[-1] - 1)
            seq.cached = end
        width = max(len(s.blocks) for s in seqs)
        tables = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.blocks)] = s.blocks
        feeds = {
            "input_ids": np.array([ids], np.int64),
            "position_ids": np.array([pos], np.int64),
            "block_tables": tables,
            "seq_lens": np.array(lens, np.int32),
            "query_start_loc": np.array(qsl, np.int32),
            "slot_mapping": np.array(slots, np.int64),
            "logits_indices": np.array(last, np.int64),
        }
        for i, cache in enumerate(self.caches):
            feeds[f"kv_cache.{i}"] = cache
        names = ["logits"] + [f"kv_cache_out.{i}" for i in range(len(self.caches))]
        logits, *caches = self.sess.run(names, feeds)
        self.caches = caches
        return logits


class ReferenceRunner:
    """Runs the original graph one sequence at a time with past KV (batch 1, attention_mask all ones)."""

    def __init__(self, sess: ort.InferenceSession):
        self.sess = sess
        self.inputs = {i.name: i for i in sess.get_inputs()}
        self.past_names = [n for n in self.inputs if n.startswith("past_key_values")]

    def new_state(self, num_kv_heads: int, head_dim: int, dtype=np.float32) -> dict:
        return {n: np.zeros((1, num_kv_heads, 0, head_dim), dtype) for n in self.past_names}

    def step(self, past: dict, tokens: list[int], start: int) -> tuple[np.ndarray, dict]:
        n = len(tokens)
        feeds = {"input_ids": np.array([tokens], np.int64), "position_ids": np.arange(start, start + n)[None]}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, start + n), np.int64)
        feeds.update(past)
        outs = self.sess.run(None, feeds)
        names = [o.name for o in self.sess.get_outputs()]
        by_name = dict(zip(names, outs))
        new_past = {p: by_name[p.replace("past_key_values", "present")] for p in self.past_names}
        return by_name["logits"][0, -1], new_past


def compare_generation(
    fused: ort.InferenceSession,
    original: ort.InferenceSession,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    prompts: list[list[int]],
    decode_steps: int = 4,
    chunk: int | None = None,
) -> float:
    """Greedy multi-step generation of several packed sequences; returns the max |Δlogits| vs the original.

    Step 1 prefills every prompt (the first one in chunks of ``chunk`` when given, so chunked prefill and a
    finished prefill share a step), then each step decodes one token per sequence, all packed together.
    """
    paged = PagedRunner(
        fused, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    ref = ReferenceRunner(original)
    seqs = [Seq(list(p)) for p in prompts]
    pasts = [ref.new_state(num_kv_heads, head_dim) for _ in prompts]
    worst = 0.0
    pending = [len(p) for p in prompts]
    while any(pending) or decode_steps > 0:
        if any(pending):
            counts = [min(n, chunk) if (chunk and i == 0) else n for i, n in enumerate(pending)]
        else:
            counts = [1] * len(seqs)
            decode_steps -= 1
        active = [i for i, n in enumerate(counts) if n]
        logits = paged.step([seqs[i] for i in active], [counts[i] for i in active])
        for row, i in enumerate(active):
            start = seqs[i].cached - counts[i]
            expected, pasts[i] = ref.step(pasts[i], seqs[i].tokens[start : seqs[i].cached], start)
            worst = max(worst, float(np.abs(logits[row] - expected).max()))
            if pending[i]:
                pending[i] -= counts[i]
            if not pending[i]:
                seqs[i].tokens.append(int(np.argmax(expected)))
    return worst
