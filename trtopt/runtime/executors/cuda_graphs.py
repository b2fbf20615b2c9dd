"""CUDA graphs for decode steps of the torch executor (DESIGN.md §5), one graph per bucket of batch sizes.

A decode step (one new token per sequence, T = S = N) of s sequences is padded up to the next bucket B >= s and
replayed from a graph captured for B. Static input buffers are filled in place; padding rows are dummy
sequences that write nothing (slot −1), read only the null block 0 (seq_len 1, block table of zeros) and whose
logits are dropped. Everything else in a fused plan is shape arithmetic on the host (see onnx_to_torch) plus the
Triton PagedAttention kernel, both capturable; a plan that does sync fails at capture, which turns graphs off
for the executor with a warning instead of failing the step.

The padding logic (`pad_decode_step`) is plain torch and is tested on CPU; capture and replay need a GPU and are
covered by a `gpu` test.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from trtopt.runtime.batch import StepInputs
from trtopt.signature import SLOT_MAPPING, STEP_INPUT_NAMES

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then every multiple of 16 up to max_num_seqs (itself always a bucket), as vLLM does.

    Doubling alone would pad 129 running sequences to 256 rows; steps of 16 keep the padding under 16 rows
    (<= 11% past 144) for ~max_num_seqs/16 more graphs, captured at start-up into one shared memory pool."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return (*sizes, max_num_seqs)


def is_decode_step(step: StepInputs) -> bool:
    """One new token per sequence, and logits for every row (T = S = N)."""
    s = step.num_seqs
    if s == 0 or step.num_tokens != s or step.logits_indices.shape[0] != s:
        return False
    return bool(torch.equal(step.query_start_loc, torch.arange(s + 1, dtype=step.query_start_loc.dtype)))


def pad_decode_step(step: StepInputs, bucket: int, max_blocks_per_seq: int) -> StepInputs:
    """The decode step padded to `bucket` sequences and `max_blocks_per_seq` table columns (fixed shapes)."""
    s, width = step.num_seqs, step.block_tables.shape[1]
    assert s <= bucket and width <= max_blocks_per_seq, (s, bucket, width, max_blocks_per_seq)
    tables = torch.zeros((bucket, max_blocks_per_seq), dtype=torch.int32)  # padding reads the null block 0
    tables[:s, :width] = step.block_tables
    seq_lens = torch.ones(bucket, dtype=torch.int32)  # a dummy sequence holds one (null) token
    seq_lens[:s] = step.seq_lens
    slots = torch.full((bucket,), -1, dtype=torch.int64)  # dummy rows write nothing
    slots[:s] = step.slot_mapping
    ids = torch.zeros((1, bucket), dtype=torch.int64)
    ids[:, :s] = step.input_ids
    positions = torch.zeros((1, bucket), dtype=torch.int64)
    positions[:, :s] = step.position_ids
    return StepInputs(
        input_ids=ids,
        position_ids=positions,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        slot_mapping=slots,
        logits_indices=torch.arange(bucket, dtype=torch.int64),
    )


def dummy_decode_step(bucket: int, max_blocks_per_seq: int) -> StepInputs:
    """A decode step of `bucket` padding rows only (what capture runs: it writes nothing, reads the null block)."""
    return StepInputs(
        input_ids=torch.zeros((1, bucket), dtype=torch.int64),
        position_ids=torch.zeros((1, bucket), dtype=torch.int64),
        block_tables=torch.zeros((bucket, max_blocks_per_seq), dtype=torch.int32),
        seq_lens=torch.ones(bucket, dtype=torch.int32),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        slot_mapping=torch.full((bucket,), -1, dtype=torch.int64),
        logits_indices=torch.arange(bucket, dtype=torch.int64),
    )


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static device buffers, refilled before each replay
    logits: torch.Tensor  # static output [bucket, vocab]


class DecodeGraphs:
    """Captures lazily, per bucket, the step function `run(feeds) -> logits` and replays it for decode steps."""

    def __init__(self, run: Callable[[dict[str, torch.Tensor]], torch.Tensor], *, device: torch.device,
                 max_num_seqs: int, max_blocks_per_seq: int):
        self.run = run
        self.device = device
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enabled = True
        self._captured: dict[int, _Captured] = {}
        self._pool = None  # one memory pool shared by every bucket's graph

    def reset(self) -> None:
        """Forget every graph (the KV pools they captured by address were reallocated)."""
        self._captured.clear()
        self._pool = None  # the memory pool died with its graphs; capturing into it trips an allocator assert

    def capture_all(self) -> None:
        """Capture every bucket now (at start-up, as vLLM does), so that no step pays for a capture."""
        for bucket in self.buckets:
            if not self.enabled:
                return
            if bucket not in self._captured:
                self._capture(bucket, dummy_decode_step(bucket, self.max_blocks_per_seq))

    def try_run(self, step: StepInputs) -> torch.Tensor | None:
        """Logits [s, vocab] from a graph replay, or None when the step is not a graphable decode step."""
        if not self.enabled or not is_decode_step(step) or step.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        s = step.num_seqs
        bucket = next((b for b in self.buckets if b >= s), None)
        if bucket is None:
            return None
        padded = pad_decode_step(step, bucket, self.max_blocks_per_seq)
        captured = self._captured.get(bucket) or self._capture(bucket, padded)
        if captured is None:
            return None
        for name in STEP_INPUT_NAMES:
            captured.inputs[name].copy_(getattr(padded, name), non_blocking=True)
        captured.graph.replay()
        return captured.logits[:s].clone()

    def _capture(self, bucket: int, example: StepInputs) -> _Captured | None:
        # Capture with an all-dummy step (every slot −1): warm-up runs really execute and must not touch the pools.
        inputs = {name: getattr(example, name).to(self.device) for name in STEP_INPUT_NAMES}
        inputs[SLOT_MAPPING.name].fill_(-1)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels and settles the allocator before capture
                    self.run(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.run(inputs)
            self._pool = graph.pool()
        except RuntimeError as e:  # e.g. an op that syncs with the host cannot be captured
            log.warning("CUDA graph capture failed for %d sequences (%s); decode steps run eagerly", bucket, e)
            self.enabled = False
            return None
        self._captured[bucket] = _Captured(graph, inputs, logits)
        return self._captured[bucket]
