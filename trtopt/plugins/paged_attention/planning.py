"""PagedAttention's launch planning (docs/architecture.md §4, STYLE.md §10): the tiling of a step from its shapes
(`plan_paged_launch`), and what the launches keep between calls, owned by one object (`PagedLaunchState`).

The torch executor owns one PagedLaunchState and passes it to every PagedAttention call it makes (trtopt_ops.py),
CUDA-graph captures included; a call without one plans nothing past itself (attention.py `paged_attention_triton`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from trtopt.plugins.kernel_common import next_pow2
from trtopt.plugins.launcher import Launcher


@dataclass(frozen=True)
class PagedLaunch:
    """How one step's attention is tiled; a pure function of shapes, so it never syncs with the device."""

    block_q: int  # query tokens per tile
    tile_n: int  # key positions per inner-loop iteration
    num_segments: int  # key-range splits (flash-decoding); 1 = write the output directly
    num_warps: int
    num_stages: int


@functools.cache
def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small number keeps split-KV exercised by small CPU tests
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=512)
def plan_paged_launch(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, max_context: int,
                      sm_count: int, *, interpret: bool = False, kv_bytes: int = 2) -> PagedLaunch:
    """Pick the tiling from shapes: the mean new tokens per sequence tells decode-like steps from prefill-like.

    Cached: every layer of a step has the same shapes, so the plan is made once per step shape (STYLE.md §10).

    The thresholds come from the H200 sweep in docs/benchmarks/NOTES.md: decode reads fastest with 128-key tiles
    and 4 warps once a program walks >= 2K keys; short per-program ranges (heavy split-KV) prefer 32-key tiles.
    An FP8 pool (kv_bytes=1) moves half the bytes a key: its decode splits into programs of >= 512 keys, at most
    32 segments, in 128-key tiles from 1024 keys a program, else 64. H200 sweeps, graph replays
    (docs/benchmarks/fp8_decode_sweeps_h200.json): B1·L32K D128 41.4 µs at 32 segments × 128 keys against 44.1
    at 64 × 128 and 59.3 at the bf16 plan's 64 × 32; batch 1 after 8K keys at head_dim 64 (the e2e model) 21.5 µs
    at 16 × 64 (bf16 23.0), and that model's engine decode after a 7936-token prompt went from 0.944x to 0.983x
    bf16 with it (fp8_kv_e2e_h200.json against 8 × 128 the same session). B16·L8K and B64·L4K keep bf16's plan
    (within 4% of their best cell).
    """
    group_pad = next_pow2(group)
    tokens_per_seq = num_tokens / max(num_seqs, 1)
    # tl.dot wants at least 16 rows; decode-like steps use the smallest tile, prefill-like ones 64/128 rows.
    rows = 16 if tokens_per_seq <= 4 else (64 if tokens_per_seq <= 64 else 128)
    block_q = max(1, rows // group_pad)
    num_tiles = (num_tokens // block_q + num_seqs) * num_kv_heads
    num_segments = 1
    # Split the key range until the launch has about two programs per SM, each keeping >= 256 keys (FP8: >= 512
    # keys and at most 32 segments). Doubling from s segments needs max_context >= s · split_keys.
    split_keys = 512 if kv_bytes > 1 else 1024
    max_segments = 64 if kv_bytes > 1 else 32
    while (num_segments < max_segments and num_tiles * num_segments < 2 * sm_count
           and max_context >= num_segments * split_keys):
        num_segments *= 2
    keys_per_program = max_context // num_segments
    if interpret:
        return PagedLaunch(block_q=block_q, tile_n=16, num_segments=min(num_segments, 4), num_warps=4, num_stages=1)
    if rows >= 64:
        # Prefill-like: 128 query rows stream 32-key tiles best (registers stay free for the pipeline).
        return PagedLaunch(block_q=block_q, tile_n=32 if rows >= 128 else 64, num_segments=num_segments,
                           num_warps=4, num_stages=3)
    if kv_bytes == 1:
        tile_n = 128 if keys_per_program >= 1024 else 64
    else:
        tile_n = 128 if keys_per_program >= 2048 else (64 if keys_per_program >= 1024 else 32)
    return PagedLaunch(block_q=block_q, tile_n=tile_n, num_segments=num_segments, num_warps=4, num_stages=3)



def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.get_device(), t.is_contiguous()


class _MetadataMemo:
    """The step metadata's four tensors last seen, read once per step (STYLE.md §10): their part of a plan key, and
    the (num_tokens, device) the full path last checked them for. Every layer of a step passes the same four
    objects; holding them keeps their ids from being reused by other tensors, so an `is` match means the very
    tensors it was read from, and their shapes are compared too (~1 µs), so a tensor resized in place since is read
    again (and checked again)."""

    __slots__ = ("tensors", "shapes", "value", "checked")

    def __init__(self) -> None:
        self.tensors: tuple = ()
        self.shapes: tuple = ()
        self.value: tuple = ()
        self.checked: tuple | None = None

    def key(self, *tensors: torch.Tensor) -> tuple:
        shapes = tuple(t.shape for t in tensors)
        if shapes == self.shapes and all(a is b for a, b in zip(tensors, self.tensors)):
            return self.value
        self.tensors, self.shapes, self.value = tensors, shapes, tuple(_tensor_key(t) for t in tensors)
        self.checked = None
        return self.value


class WorkspaceBudget:
    """The device memory the plans of one PagedLaunchState keep between calls (attention.py `_PagedPlan._workspace`:
    a long prefill's rotated q is megabytes), at most `limit` bytes in all."""

    __slots__ = ("limit", "owned")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.owned = 0

    def take(self, nbytes: int) -> bool:
        """Count nbytes as kept, if they fit; False (nothing counted) when they do not."""
        if self.owned + nbytes > self.limit:
            return False
        self.owned += nbytes
        return True


class PagedLaunchState:
    """What PagedAttention keeps between calls, in one place (STYLE.md §1, §12). The torch executor owns one and
    passes it to each call (`paged_attention_triton(..., state=)`); tests and benchmarks make their own.

    - `plans`: the plans made so far (attention.py `_PagedPlan`), by `plan_key`. Bounded: a workload whose step
      shapes never repeat drops them and refills. `budget`: the device memory their workspaces keep.
    - `metadata`: the step metadata last read (`_MetadataMemo`), so that its part of a key and its checks are made
      once per step, not per layer.
    - Split-KV's merge in the attention launch (`MERGE`): `counters`, one int32 counter per (query tile, KV head),
      zero between launches (the merging program resets its own). One buffer per device, shared by every plan and
      layer: the launches that use it run one after another on the stream of the thread that owns the engine (or in
      a graph captured from it), never two at once. Allocated zeroed once, outside any graph capture (a capture
      would record the zeroing and replay it); a launch that needs more than `merge_counter_slots` counters, or
      comes first inside a capture, merges in a second launch instead. `merge_in_kernel = False` turns the fused
      merge off (benchmarks' ablation; clear_plans() after changing it: plans hold their launches).
    - `launcher`: what its launches go through; `launcher.dispatcher_only = True` sends them through Triton's
      dispatcher and plans nothing (the A/B baseline; TRTOPT_TRITON_DISPATCH=1 when the state is made).
    - `cuda_decode`: FP8 pools' decode steps take the CUDA kernel where it serves them (decode_cuda.py `why_not`);
      False keeps them on the Triton kernel (benchmarks' A/B and tests; clear_plans() after changing it).
    """

    def __init__(self, *, merge_in_kernel: bool = True, launcher: Launcher | None = None, max_plans: int = 256,
                 max_owned_bytes: int = 64 << 20, merge_counter_slots: int = 4096, cuda_decode: bool = True) -> None:
        self.merge_in_kernel = merge_in_kernel
        self.cuda_decode = cuda_decode
        self.launcher = launcher if launcher is not None else Launcher()
        self.max_plans = max_plans
        self.merge_counter_slots = merge_counter_slots
        self.plans: dict[tuple, Any] = {}  # plan_key → attention.py _PagedPlan
        self.budget = WorkspaceBudget(max_owned_bytes)
        self.metadata = _MetadataMemo()
        self.counters: dict[torch.device, torch.Tensor] = {}

    def remember(self, key: tuple, plan: Any) -> None:
        if len(self.plans) >= self.max_plans:
            self.clear_plans()
        self.plans[key] = plan

    def clear_plans(self) -> None:
        """Drop every plan (their workspaces go back to torch's allocator with them); the next call of each shape
        plans again. For tests and benchmarks that need a first call."""
        self.plans.clear()
        self.budget.owned = 0

    def merge_counters(self, device: torch.device, programs: int) -> torch.Tensor | None:
        """The device's merge counters, or None where the launch must merge in a second kernel."""
        if not self.merge_in_kernel or programs > self.merge_counter_slots:
            return None
        counters = self.counters.get(device)
        if counters is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            counters = self.counters[device] = torch.zeros(self.merge_counter_slots, dtype=torch.int32,
                                                           device=device)
        return counters

    def plan_key(self, q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, num_heads,
                 num_kv_heads, head_dim, scale, causal, sliding_window, alibi_slopes, rope_cos, rope_sin,
                 kv_written=False) -> tuple:
        """Everything a plan's launches were computed from: the attributes, and every input's shape, strides, dtype
        and device (tensor addresses are bound per call). The metadata tensors are the same four objects for every
        layer of a step, so theirs is read once per step (`metadata`). With kv_written no launch reads k or v (the
        pool already holds them; the layout check at planning is the caller's promise for later calls), so the key
        of the batch-1 decode path leaves them out: it is computed for every layer of every eager step."""
        if kv_written:
            return (
                q.shape, q.stride(), kv_cache.shape, kv_cache.stride(), q.dtype, kv_cache.dtype, q.get_device(),
                kv_cache.get_device(), self.metadata.key(block_tables, seq_lens, query_start_loc, slot_mapping),
                num_heads, num_kv_heads, head_dim, scale, causal, sliding_window,
                None if alibi_slopes is None else _tensor_key(alibi_slopes), rope_cos is None, rope_sin is None, True,
            )
        return (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), kv_cache.shape, kv_cache.stride(),
            q.dtype, k.dtype, v.dtype, kv_cache.dtype, q.get_device(), k.get_device(), v.get_device(),
            kv_cache.get_device(), self.metadata.key(block_tables, seq_lens, query_start_loc, slot_mapping),
            num_heads, num_kv_heads, head_dim, scale, causal, sliding_window,
            None if alibi_slopes is None else _tensor_key(alibi_slopes),
            None if rope_cos is None else _tensor_key(rope_cos),
            None if rope_sin is None else _tensor_key(rope_sin), kv_written,
        )
