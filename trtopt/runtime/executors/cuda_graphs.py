"""CUDA graphs for every step of the torch executor (docs/architecture.md §5): full graphs at bucketed shapes.

A step of T tokens, S sequences and N logits rows (any mix: decode rows, prefill chunks, several rows of one
sequence for speculative verification) is padded up to the smallest bucket (T_b, S_b, N_b) that holds it and
replayed from the graph captured for that bucket. Buckets are keyed by T alone:

- T_b: 1, 2, 4, 8, then every 16 up to max_num_seqs (the decode sizes, where T = S), then ×1.25 steps rounded up
  to a multiple of 16 until max_num_tokens (mixed and prefill steps: padding stays under 25%);
- S_b = min(T_b, max_num_seqs) and N_b = min(T_b, max_logits): S <= T and N <= T always hold, so only a step with
  more than max_logits logits rows (default max_num_seqs) has no bucket and runs eagerly.

Padding is chosen so that it changes nothing and needs no host sync:
- padding tokens (rows T..T_b) belong to no sequence: query_start_loc ends at T for every padding sequence, their
  slot is −1 (no KV write), their id and position 0. PagedAttention leaves their output rows unwritten; every other
  op of a decoder is row-wise, and no logits row reads them;
- padding sequences (S..S_b) own zero tokens, read only the null block 0 (a table of zeros) and have seq_len 1;
- padding logits rows gather row 0 and are dropped.

The paged signature's no-host-sync rule (shapes alone decide every launch) is what makes a captured graph valid for
any metadata values. All graphs share one memory pool, one device input buffer and one logits buffer, and are
captured largest first at start-up, so capture memory is about that of the largest step. The step inputs are packed
per bucket into that one buffer (`input_layout`: each field 64-byte aligned), so a step costs one host-to-device
copy of its bucket's bytes from a pinned mirror, not one per input. A plan that does sync fails at capture, which
turns graphs off for the executor with a warning instead of failing the step.

Each graph also holds the two small steps around the model that a served greedy step needs (StepGraphs'
`argmax_in_graph`, on by default): it first fills async scheduling's placeholder ids from the previous step's
greedy tokens (one device buffer, `tokens`), and last writes the argmax of its logits rows into that same buffer,
where the engine's sampler takes plain greedy rows from (`last_tokens`) and the next graph's fill reads them.
Without it (benchmarks turn it off to time them in the same run) those are three launches from Python per step (the
fill and the argmax's two, ~20 µs of host time each), between replays.
A step whose placeholders name tokens that did not come from that buffer (an eager or host-sampled step before it)
has them copied there first (one copy).

The bucketing and padding are plain torch and tested on CPU; capture and replay need a GPU (`gpu` tests).
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
import math
import time
from typing import Callable

import torch

from trtopt.runtime.batch import StepInputs, fill_placeholders_
from trtopt.runtime.kernels.argmax import greedy_argmax
from trtopt.signature import (
    BLOCK_TABLES, INPUT_IDS, LOGITS_INDICES, POSITION_IDS, QUERY_START_LOC, SEQ_LENS, SLOT_MAPPING, STEP_INPUT_NAMES,
    STEP_INPUTS,
)

_IDS, _POS, _TABLES, _LENS, _QSL, _SLOTS, _ROWS = (spec.name for spec in (
    INPUT_IDS, POSITION_IDS, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC, SLOT_MAPPING, LOGITS_INDICES))

log = logging.getLogger(__name__)

# run(feeds, logits_out) -> logits: one step of the model on device feeds, logits written into logits_out if given.
StepFn = Callable[[dict[str, torch.Tensor], "torch.Tensor | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True, order=True)
class GraphBucket:
    """The padded shape of a graphed step: T tokens, S sequences, N logits rows."""

    num_tokens: int
    num_seqs: int
    num_logits: int

    def holds(self, step: StepInputs) -> bool:
        return (step.num_tokens <= self.num_tokens and step.num_seqs <= self.num_seqs
                and step.logits_indices.shape[0] <= self.num_logits)


def token_buckets(max_num_seqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """The token counts T_b (see the module docstring); max_num_seqs and max_num_tokens are always buckets."""
    decode = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    sizes = [t for t in decode if t <= max_num_tokens]
    t = sizes[-1]
    while t < max_num_tokens:
        t = min(max_num_tokens, -(-(t * 5 // 4) // 16) * 16)
        sizes.append(t)
    if sizes[-1] != max_num_tokens:
        sizes.append(max_num_tokens)
    return tuple(sizes)


def graph_buckets(max_num_seqs: int, max_num_tokens: int, max_logits: int | None = None) -> tuple[GraphBucket, ...]:
    """Every bucket, smallest first. max_logits (default max_num_seqs) caps N_b: the logits rows are [N_b, vocab]."""
    cap = max_logits or max_num_seqs
    return tuple(GraphBucket(t, min(t, max_num_seqs), min(t, cap)) for t in token_buckets(max_num_seqs, max_num_tokens))


def _num_tokens(bucket: GraphBucket) -> int:
    return bucket.num_tokens


def pad_step(step: StepInputs, bucket: GraphBucket, max_blocks_per_seq: int) -> StepInputs:
    """The step padded to `bucket` (fixed shapes; block tables `max_blocks_per_seq` wide). CPU tensors."""
    t, s, n = step.num_tokens, step.num_seqs, step.logits_indices.shape[0]
    width = step.block_tables.shape[1]
    assert bucket.holds(step) and width <= max_blocks_per_seq, (t, s, n, width, bucket, max_blocks_per_seq)
    tb, sb, nb = bucket.num_tokens, bucket.num_seqs, bucket.num_logits
    ids = torch.zeros((1, tb), dtype=torch.int64)
    ids[:, :t] = step.input_ids
    positions = torch.zeros((1, tb), dtype=torch.int64)
    positions[:, :t] = step.position_ids
    tables = torch.zeros((sb, max_blocks_per_seq), dtype=torch.int32)  # padding reads the null block 0
    tables[:s, :width] = step.block_tables
    seq_lens = torch.ones(sb, dtype=torch.int32)
    seq_lens[:s] = step.seq_lens
    starts = torch.full((sb + 1,), t, dtype=torch.int32)  # padding sequences own no tokens; padding rows no sequence
    starts[: s + 1] = step.query_start_loc
    slots = torch.full((tb,), -1, dtype=torch.int64)  # padding rows write nothing
    slots[:t] = step.slot_mapping
    logits = torch.zeros(nb, dtype=torch.int64)
    logits[:n] = step.logits_indices
    return StepInputs(input_ids=ids, position_ids=positions, block_tables=tables, seq_lens=seq_lens,
                      query_start_loc=starts, slot_mapping=slots, logits_indices=logits)


def dummy_step(bucket: GraphBucket, max_blocks_per_seq: int) -> StepInputs:
    """A step of `bucket`'s shape that is all padding (what capture runs: it writes nothing, reads the null block)."""
    tb, sb = bucket.num_tokens, bucket.num_seqs
    return StepInputs(
        input_ids=torch.zeros((1, tb), dtype=torch.int64),
        position_ids=torch.zeros((1, tb), dtype=torch.int64),
        block_tables=torch.zeros((sb, max_blocks_per_seq), dtype=torch.int32),
        seq_lens=torch.ones(sb, dtype=torch.int32),
        query_start_loc=torch.zeros(sb + 1, dtype=torch.int32),
        slot_mapping=torch.full((tb,), -1, dtype=torch.int64),
        logits_indices=torch.zeros(bucket.num_logits, dtype=torch.int64),
    )


_DTYPES = {spec.name: getattr(torch, spec.dtype) for spec in STEP_INPUTS}
_ALIGN = 64  # bytes: every field of the packed inputs keeps the 16-byte alignment the kernels are specialised on


def input_layout(bucket: GraphBucket, max_blocks_per_seq: int) -> tuple[dict[str, tuple[int, torch.dtype, tuple]], int]:
    """Where each step input of `bucket` lives in the one packed buffer a step copies to the device: name →
    (byte offset, dtype, shape), in STEP_INPUT_NAMES order, and the bytes the bucket uses."""
    tb, sb, nb = bucket.num_tokens, bucket.num_seqs, bucket.num_logits
    shapes = {_IDS: (1, tb), _POS: (1, tb), _TABLES: (sb, max_blocks_per_seq), _LENS: (sb,), _QSL: (sb + 1,),
              _SLOTS: (tb,), _ROWS: (nb,)}
    layout, offset = {}, 0
    for name in STEP_INPUT_NAMES:
        dtype = _DTYPES[name]
        layout[name] = (offset, dtype, shapes[name])
        offset += -(-math.prod(shapes[name]) * dtype.itemsize // _ALIGN) * _ALIGN
    return layout, offset


def field_views(buffer: torch.Tensor, layout: dict[str, tuple[int, torch.dtype, tuple]]) -> dict[str, torch.Tensor]:
    """Typed views of a uint8 `buffer` (host or device) at `layout`'s offsets."""
    views = {}
    for name, (offset, dtype, shape) in layout.items():
        size = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offset : offset + size].view(dtype).view(shape)
    return views


def pack_step(step: StepInputs, fields: dict) -> None:
    """Write `step`, padded as pad_step pads it, into `fields` (numpy views of one bucket's packed inputs, as
    field_views(...) of the pinned buffer gives them): one Python pass of slice writes, no torch op per field."""
    t, s, n = step.num_tokens, step.num_seqs, step.logits_indices.shape[0]
    width = step.block_tables.shape[1]
    ids, pos, tables = fields[_IDS], fields[_POS], fields[_TABLES]
    ids[0, :t] = step.input_ids.numpy()[0]
    ids[0, t:] = 0
    pos[0, :t] = step.position_ids.numpy()[0]
    pos[0, t:] = 0
    fields[_SLOTS][:t] = step.slot_mapping.numpy()
    fields[_SLOTS][t:] = -1
    tables[:s, :width] = step.block_tables.numpy()
    tables[:s, width:] = 0
    tables[s:] = 0
    fields[_LENS][:s] = step.seq_lens.numpy()
    fields[_LENS][s:] = 1
    fields[_QSL][: s + 1] = step.query_start_loc.numpy()
    fields[_QSL][s + 1 :] = t
    fields[_ROWS][:n] = step.logits_indices.numpy()
    fields[_ROWS][n:] = 0


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What start-up capture cost (logged, and read by benchmarks)."""

    num_graphs: int
    seconds: float
    pool_bytes: int  # device memory the graphs' shared pool and buffers took (torch's reserved memory grew by it)


class StepGraphs:
    """Captures the step function per bucket (all at start-up, or lazily) and replays it for any step that fits.

    argmax_in_graph (default on): each graph also fills the placeholders and takes the greedy argmax (module
    docstring); off, both are launched from Python between replays. argmax_kernel: that argmax through the Triton
    kernel (kernels/argmax.py; off: torch.argmax, an ablation)."""

    def __init__(self, run: StepFn, *, device: torch.device, max_num_seqs: int, max_num_tokens: int,
                 max_blocks_per_seq: int, max_logits: int | None = None, argmax_in_graph: bool = True,
                 argmax_kernel: bool = True):
        self.run = run
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buckets = graph_buckets(max_num_seqs, max_num_tokens, max_logits)
        self.enabled = True
        self.decode_only = False  # ablations: graph only steps of one token per sequence (the pre-issue-11 rule)
        self.num_replayed = 0  # steps replayed from a graph
        self.num_eager = 0  # steps that fit no bucket (or came while graphs were off) and ran eagerly
        self.capture_report: CaptureReport | None = None
        self._captured: dict[GraphBucket, torch.cuda.CUDAGraph] = {}
        self._pool = None  # one memory pool shared by every bucket's graph
        # Every step input lives in one device buffer, packed per bucket (input_layout): a step is one host-to-device
        # copy of its bucket's bytes from one pinned mirror. Graphs read their bucket's views of it.
        self._device_bytes: torch.Tensor | None = None
        self._host_bytes: torch.Tensor | None = None  # pinned, refilled every step
        self._fields: dict[GraphBucket, tuple[dict[str, torch.Tensor], dict, int]] = {}  # device views, host
        # numpy views (slice writes without torch dispatch), bytes used
        self._logits: torch.Tensor | None = None  # [largest N_b, vocab] fp32, written by every graph
        self._copied = torch.cuda.Event()  # recorded after each step's host-to-device copies
        self.argmax_in_graph = argmax_in_graph
        self.argmax_kernel = argmax_kernel
        # int64 [largest N_b]: each graph reads the previous step's greedy tokens from it (placeholders), then writes
        # the argmax of its own logits rows there. None while argmax_in_graph is off.
        self._tokens: torch.Tensor | None = None
        # The argmax of the last replayed step's N logits rows (a view of _tokens, valid until the next replay);
        # None after a step that ran eagerly, or with argmax_in_graph off.
        self.last_tokens: torch.Tensor | None = None

    def set_buckets(self, buckets: tuple[GraphBucket, ...]) -> None:
        """Use other buckets (ablations); forgets the captured graphs."""
        self.reset()
        self.buckets = tuple(sorted(buckets))

    def reset(self) -> None:
        """Forget every graph (the KV pools they captured by address were reallocated)."""
        self._captured.clear()
        self._pool = None  # the memory pool died with its graphs; capturing into it trips an allocator assert
        self._device_bytes = self._host_bytes = None
        self._fields.clear()
        self._logits = None
        self._tokens = self.last_tokens = None

    def capture_all(self) -> CaptureReport:
        """Capture every bucket now, largest first (so that smaller graphs reuse its pool memory), as vLLM does."""
        torch.cuda.synchronize(self.device)
        # Return the memory of graphs and pools already dropped (reset) first, so the reserved-memory delta below is
        # what this capture took (warm-up runs, the shared pool and buffers), not that minus a late release.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        for bucket in reversed(self.buckets):
            if not self.enabled:
                break
            if bucket not in self._captured:
                self._capture(bucket)
        torch.cuda.synchronize(self.device)
        self.capture_report = CaptureReport(len(self._captured), time.perf_counter() - started,
                                            torch.cuda.memory_reserved(self.device) - reserved)
        log.info("captured %d CUDA graphs (T up to %d) in %.1f s, %.0f MiB", self.capture_report.num_graphs,
                 self.buckets[-1].num_tokens, self.capture_report.seconds, self.capture_report.pool_bytes / 2**20)
        return self.capture_report

    @staticmethod
    def bucket_of(buckets: tuple[GraphBucket, ...], step: StepInputs) -> GraphBucket | None:
        """The smallest of `buckets` (sorted) that holds the step, or None."""
        i = bisect.bisect_left(buckets, step.num_tokens, key=_num_tokens)
        return next((b for b in buckets[i:] if b.holds(step)), None)

    def bucket_for(self, step: StepInputs) -> GraphBucket | None:
        if step.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        if self.decode_only and not (step.num_tokens == step.num_seqs == step.logits_indices.shape[0]):
            return None
        return self.bucket_of(self.buckets, step)

    def try_run(self, step: StepInputs) -> torch.Tensor | None:
        """Logits [N, vocab] from a graph replay, or None when the step has no bucket (it then runs eagerly)."""
        bucket = self.bucket_for(step) if self.enabled else None
        graph = None
        self.last_tokens = None
        if bucket is not None:
            graph = self._captured.get(bucket) or self._capture(bucket)
        if graph is None:
            self.num_eager += 1
            return None
        self._fill(step, bucket)
        graph.replay()
        self.num_replayed += 1
        n = step.logits_indices.shape[0]
        if self._tokens is not None:
            self.last_tokens = self._tokens[:n]
        return self._logits[:n].clone()

    def _fill(self, step: StepInputs, bucket: GraphBucket) -> None:
        """Pack the step, padded to the bucket, into the pinned buffer and copy the bucket's bytes to the device in
        one asynchronous copy. Async scheduling's placeholders are filled on the device: inside the graph from the
        tokens buffer (copied there first unless the previous step's tokens are already in it), or by one launch
        when the graphs hold no fill."""
        self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        device, host, nbytes = self._bucket_fields(bucket)
        pack_step(step, host)
        self._device_bytes[:nbytes].copy_(self._host_bytes[:nbytes], non_blocking=True)
        self._copied.record()
        sampled, tokens = step.sampled_ids, self._tokens
        if sampled is None or not sampled.numel():
            return
        if tokens is not None and sampled.data_ptr() == tokens.data_ptr():
            return  # the previous replay's own tokens: the graph's fill reads them where they are
        if tokens is not None and sampled.numel() <= tokens.numel():
            tokens[: sampled.numel()].copy_(sampled)  # the graph's fill reads them from there
        else:  # no fill in the graphs, or more rows than the buffer holds: fill here (the graph's finds none left)
            fill_placeholders_(device[_IDS], sampled)

    def sampled_ids_buffer(self, count: int) -> torch.Tensor | None:
        """Where a step's ``count`` sampled ids can be written (a tensor-parallel worker receives them there) so that
        `_fill` copies nothing and the replay's fill reads them in place: a view of the tokens buffer. None when the
        graphs hold no fill, or fewer rows than ``count``."""
        tokens = self._tokens
        return tokens[:count] if tokens is not None and count <= tokens.numel() else None

    def device_inputs(self, bucket: GraphBucket) -> dict[str, torch.Tensor]:
        """The device inputs `bucket`'s graph reads (views of the packed buffer), by signature name."""
        return self._bucket_fields(bucket)[0]

    def _bucket_fields(self, bucket: GraphBucket) -> tuple[dict[str, torch.Tensor], dict, int]:
        """(device views, host numpy views, bytes) of the bucket's packed inputs; the buffers hold the largest."""
        fields = self._fields.get(bucket)
        if fields is None:
            if self._device_bytes is None:
                size = max(input_layout(b, self.max_blocks_per_seq)[1] for b in self.buckets)
                self._device_bytes = torch.zeros(size, dtype=torch.uint8, device=self.device)
                self._host_bytes = torch.zeros(size, dtype=torch.uint8).pin_memory()
            layout, nbytes = input_layout(bucket, self.max_blocks_per_seq)
            host = {name: view.numpy() for name, view in field_views(self._host_bytes, layout).items()}
            fields = self._fields[bucket] = (field_views(self._device_bytes, layout), host, nbytes)
        return fields

    def _graphed_step(self, inputs: dict[str, torch.Tensor], logits_out: torch.Tensor | None) -> torch.Tensor:
        """What a graph holds: the placeholder fill, the model, and the greedy argmax into the tokens buffer (only
        the model with argmax_in_graph off)."""
        if self._tokens is not None:
            fill_placeholders_(inputs[_IDS], self._tokens)
        logits = self.run(inputs, logits_out)
        if self._tokens is not None:
            greedy_argmax(logits, out=self._tokens[: logits.shape[0]], kernel=self.argmax_kernel)
        return logits

    def _capture(self, bucket: GraphBucket) -> torch.cuda.CUDAGraph | None:
        inputs = self._bucket_fields(bucket)[0]
        example = dummy_step(bucket, self.max_blocks_per_seq)  # every slot −1: warm-up runs must not touch the pools
        for name, view in inputs.items():
            view.copy_(getattr(example, name))
        if self.argmax_in_graph and self._tokens is None:
            self._tokens = torch.zeros(max(b.num_logits for b in self.buckets), dtype=torch.int64, device=self.device)
        # The warm-up runs write their argmax into the tokens buffer: a bucket captured mid-run (lazily) must leave
        # the previous step's tokens there for the step it is captured for.
        kept = self._tokens.clone() if self._tokens is not None else None
        try:
            return self._capture_retrying(bucket, inputs)
        finally:
            if kept is not None:
                self._tokens.copy_(kept)

    def _capture_retrying(self, bucket: GraphBucket, inputs: dict[str, torch.Tensor]) -> torch.cuda.CUDAGraph | None:
        for attempt in (1, 2):
            try:
                graph = self._capture_once(bucket, inputs)
                break
            except RuntimeError as e:  # e.g. an op that syncs with the host cannot be captured
                if attempt == 1:  # an invalidated capture may pass again (session 16 saw one, not reproduced)
                    log.warning("CUDA graph capture failed for %s (%s); trying once more", bucket, e)
                    continue
                log.warning("CUDA graph capture failed again for %s (%s); steps run eagerly", bucket, e)
                self.enabled = False
                return None
        self._captured[bucket] = graph
        return graph

    def _capture_once(self, bucket: GraphBucket, inputs: dict[str, torch.Tensor]) -> torch.cuda.CUDAGraph:
        """Warm the bucket's step up twice on a side stream, then capture it; raises RuntimeError if capture fails.
        The garbage collector is off while capturing (torch collects once right before), so that no finalizer runs
        inside the capture (freeing a pinned tensor touches CUDA events, which a global-mode capture forbids)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels and settles the allocator before capture
                logits = self._graphed_step(inputs, None)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._logits is None:
            largest = max(b.num_logits for b in self.buckets)
            self._logits = torch.empty((largest, logits.shape[-1]), dtype=torch.float32, device=self.device)
        del logits
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._graphed_step(inputs, self._logits[: bucket.num_logits])
        finally:
            if collecting:
                gc.enable()
        self._pool = graph.pool()
        return graph
