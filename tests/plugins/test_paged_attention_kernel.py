"""The PagedAttention Triton kernels vs the torch reference (the numerical truth).

Every case poisons what the kernel must not read or must overwrite: the output buffer, the null block 0, every
pool slot that no sequence owns, and slots past each sequence's length are NaN. A NaN that leaks into the output or
into a live cache slot fails the comparison, so reading padding, reading the null block or skipping a row shows up.
Without CUDA these run under the Triton interpreter (tests/plugins/conftest.py) on small shapes; the `gpu` sweep
below adds the large and half-precision shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtopt.plugins.launcher import Launcher
from trtopt.plugins.paged_attention import planning
from trtopt.plugins.paged_attention.kernel import (
    PagedLaunch,
    PagedLaunchState,
    copy_blocks_triton,
    paged_attention_triton,
    plan_paged_launch,
    rope_write_kv_triton,
    write_kv_triton,
)
from trtopt.plugins.paged_attention.reference import copy_blocks_ref, paged_attention_ref, write_kv
from trtopt.plugins.rope.kernel import rope_triton
from trtopt.plugins.rope.reference import rope_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Case:
    """One step: sequence s has context[s] tokens cached before the step and new[s] tokens in it."""

    context: tuple[int, ...]
    new: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    sliding_window: int = 0
    alibi: bool = False
    causal: int = 1
    dropped_slots: int = 0  # how many new tokens get slot −1 (their K/V is not written)
    dtype: torch.dtype = torch.float32
    seed: int = 0


@dataclass
class Step:
    """The op's inputs for one Case; kv_cache is poisoned with NaN wherever no live token lives."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    alibi_slopes: torch.Tensor | None
    attrs: dict


def make_step(case: Case, device: torch.device) -> Step:
    gen = torch.Generator().manual_seed(case.seed)
    Hq, Hkv, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    seq_lens = [c + n for c, n in zip(case.context, case.new)]
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column at least: tables pad with the null block 0
    num_blocks = sum(blocks_per_seq) + 3  # null block + two blocks nobody owns
    # A random permutation of physical blocks 1.. (block 0 is the null block) so logical order != physical.
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    pool = torch.full((num_blocks, 2, Hkv, bs, D), float("nan"))
    for s, nb in enumerate(blocks_per_seq):
        ids, physical = physical[:nb], physical[nb:]
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        for logical, block in enumerate(ids):
            live = min(bs, case.context[s] - logical * bs)  # cached tokens in this block before the step
            if live > 0:
                pool[block, :, :, :live] = torch.randn(2, Hkv, live, D, generator=gen)
    slots = []
    for s, n in enumerate(case.new):
        for j in range(n):
            p = case.context[s] + j
            slots.append(int(tables[s, p // bs]) * bs + p % bs)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    if case.dropped_slots:
        # A dropped token's slot keeps old (finite) data, which both implementations then read.
        dropped = torch.randperm(len(slots), generator=gen)[: case.dropped_slots]
        for t in dropped.tolist():
            block, off = divmod(slots[t], bs)
            pool[block, :, :, off] = torch.randn(2, Hkv, D, generator=gen)
        slot_mapping[dropped] = -1
    T = len(slots)
    # q arrives as a transposed view of [1, T, Hq, D] storage, as the fused graphs produce it.
    q = torch.randn(1, T, Hq, D, generator=gen).transpose(1, 2)
    k = torch.randn(1, T, Hkv, D, generator=gen).transpose(1, 2)
    v = torch.randn(1, Hkv, T, D, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(case.new).cumsum(0).tolist(), dtype=torch.int32)
    slopes = (2.0 ** (-8.0 * torch.arange(1, Hq + 1) / Hq)).float() if case.alibi else None
    to = dict(device=device)
    return Step(
        q=q.to(dtype=case.dtype, **to), k=k.to(dtype=case.dtype, **to), v=v.to(dtype=case.dtype, **to),
        kv_cache=pool.to(dtype=case.dtype, **to), block_tables=tables.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=qsl.to(**to),
        slot_mapping=slot_mapping.to(**to), alibi_slopes=None if slopes is None else slopes.to(**to),
        attrs=dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5, causal=case.causal,
                   sliding_window=case.sliding_window),
    )


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


def run_both(case: Case, device: torch.device, launch: PagedLaunch | None = None,
             state: PagedLaunchState | None = None) -> None:
    step = make_step(case, device)
    args = (step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    ref_cache = step.kv_cache.cpu().clone()
    slopes = None if step.alibi_slopes is None else step.alibi_slopes.cpu()
    ref_out, _ = paged_attention_ref(step.q.cpu(), step.k.cpu(), step.v.cpu(), ref_cache, *(a.cpu() for a in args),
                                     alibi_slopes=slopes, **step.attrs)
    out = torch.full_like(step.q.contiguous(), float("nan"))
    got_out, got_cache = paged_attention_triton(step.q, step.k, step.v, step.kv_cache, *args,
                                                alibi_slopes=step.alibi_slopes, launch=launch, out=out, **step.attrs,
                                                state=state)
    assert got_cache is step.kv_cache, "the pool must be written in place and returned as is"
    assert got_out is out
    assert not torch.isnan(got_out).any(), "NaN in the output: a row was skipped or poisoned memory was read"
    torch.testing.assert_close(got_out.cpu().float(), ref_out.float(), **tolerance(case.dtype))
    # The whole pool, NaN poison included, must match: the write touched exactly the right slots.
    torch.testing.assert_close(got_cache.cpu(), ref_cache, equal_nan=True, atol=0, rtol=0)


# Small shapes for the interpreter: every feature at least once, odd lengths everywhere.
CASES = {
    "decode_mha": Case(context=(5, 17, 1), new=(1, 1, 1), num_heads=2, num_kv_heads=2),
    "decode_gqa4_bs32": Case(context=(40, 3), new=(1, 1), num_heads=8, num_kv_heads=2, block_size=32),
    "prefill_gqa2": Case(context=(0, 0), new=(19, 7)),
    "mixed_step": Case(context=(0, 21, 9, 33), new=(13, 5, 1, 1), num_heads=4, num_kv_heads=1, seed=1),
    "mqa_gqa8_bs64": Case(context=(70, 0), new=(1, 9), num_heads=8, num_kv_heads=1, block_size=64, seed=2),
    "head_dim_80": Case(context=(11, 0), new=(3, 6), head_dim=80, seed=3),
    "head_dim_128": Case(context=(6,), new=(2,), head_dim=128, num_heads=2, num_kv_heads=1, seed=4),
    "dropped_slots": Case(context=(8, 15), new=(4, 1), dropped_slots=2, seed=5),
    "sliding_window": Case(context=(30, 4), new=(6, 1), sliding_window=9, seed=6),
    "alibi": Case(context=(12, 0), new=(1, 10), alibi=True, seed=7),
    "alibi_window_gqa4": Case(context=(25,), new=(5,), num_heads=8, num_kv_heads=2, alibi=True,
                              sliding_window=7, seed=8),
    "non_causal": Case(context=(3, 0), new=(4, 5), causal=0, seed=9),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, kernel_device: torch.device) -> None:
    run_both(CASES[name], kernel_device)


@st.composite
def random_steps(draw) -> Case:
    """A mixed step: each sequence is a prefill, a prefill chunk or a decode row, over any GQA ratio/block size."""
    num_seqs = draw(st.integers(1, 4))
    new = tuple(draw(st.sampled_from([1, 1, 2, 5, 17])) for _ in range(num_seqs))
    context = tuple(draw(st.sampled_from([0, 1, 15, 16, 33, 70])) for _ in range(num_seqs))
    num_kv_heads, group = draw(st.sampled_from([(1, 1), (2, 2), (1, 4), (1, 8), (2, 3)]))
    return Case(context=context, new=new, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                head_dim=draw(st.sampled_from([32, 80])), block_size=draw(st.sampled_from([16, 32, 64])),
                sliding_window=draw(st.sampled_from([0, 0, 6])), alibi=draw(st.booleans()),
                dropped_slots=draw(st.integers(0, 1)), seed=draw(st.integers(0, 1000)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=random_steps())
def test_random_mixed_steps_match_reference(case: Case, kernel_device: torch.device) -> None:
    run_both(case, kernel_device)


@pytest.mark.parametrize("block_q, num_segments", [(1, 4), (4, 2), (2, 1)])
def test_forced_tilings_match_reference(block_q: int, num_segments: int, kernel_device: torch.device) -> None:
    """Split-KV and odd query tiles give the default tiling's answer (tile_n 16 crosses blocks of 32)."""
    launch = PagedLaunch(block_q=block_q, tile_n=16, num_segments=num_segments, num_warps=4, num_stages=1)
    case = Case(context=(45, 0, 7), new=(1, 11, 3), num_heads=8, num_kv_heads=2, block_size=32, dropped_slots=2,
                seed=10)
    run_both(case, kernel_device, launch=launch)


def test_split_kv_with_window_leaves_empty_segments(kernel_device: torch.device) -> None:
    """A window shorter than the segments' span leaves some segments with no key: they must merge to nothing."""
    launch = PagedLaunch(block_q=1, tile_n=16, num_segments=8, num_warps=4, num_stages=1)
    run_both(Case(context=(90,), new=(1,), sliding_window=5, seed=11), kernel_device, launch=launch)


class _RecordingLauncher(Launcher):
    """A Launcher that records the names of the kernels it launches (the state's unplanned path)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def launch(self, kernel, *args, **kwargs) -> None:
        self.names.append(kernel.fn.__name__)
        super().launch(kernel, *args, **kwargs)


@pytest.mark.parametrize("in_kernel, slots", [(True, 4096), (False, 4096), (True, 1)])
def test_split_kv_merges_in_the_attention_launch_or_a_second_one(in_kernel: bool, slots: int,
                                                                  kernel_device: torch.device) -> None:
    """The last segment of each (tile, KV head) merges them, and leaves its counter at 0 for the next launch; with
    the fused merge off, or more tiles than counters, a second kernel merges. Both give the reference's answer.
    Three sequences × two KV heads × query tiles of 1 (6+ counters), a window that empties segments, and a
    sequence with a prefill chunk (tiles that exit early touch no counter)."""
    recorder = _RecordingLauncher()
    state = PagedLaunchState(merge_in_kernel=in_kernel, merge_counter_slots=slots, launcher=recorder)
    launch = PagedLaunch(block_q=1, tile_n=16, num_segments=4, num_warps=4, num_stages=1)
    for case in (Case(context=(45, 0, 70), new=(1, 5, 1), num_heads=8, num_kv_heads=2, seed=20),
                 Case(context=(90, 33), new=(1, 1), sliding_window=7, seed=21)):
        recorder.names.clear()
        run_both(case, kernel_device, launch=launch, state=state)
        fused = in_kernel and slots > 1
        assert recorder.names.count("_merge_segments_kernel") == (0 if fused else 1), recorder.names
        counters = state.counters.get(torch.empty(0, device=kernel_device).device)  # "cuda" is stored as "cuda:0"
        if fused:
            assert counters is not None and int(counters.count_nonzero()) == 0, "a merge counter was left set"


@pytest.mark.parametrize("segments", [16, 32])
def test_many_segments_merge_in_a_second_launch(segments: int, kernel_device: torch.device) -> None:
    """Up to FUSED_MERGE_MAX_SEGMENTS segments merge in the attention launch; more merge in a second one (the
    planner's segment counts are powers of two, as the second launch needs). Both give the reference's answer,
    empty segments past the keys included."""
    from trtopt.plugins.paged_attention.attention import FUSED_MERGE_MAX_SEGMENTS

    recorder = _RecordingLauncher()
    state = PagedLaunchState(merge_in_kernel=True, launcher=recorder)
    launch = PagedLaunch(block_q=1, tile_n=16, num_segments=segments, num_warps=4, num_stages=1)
    run_both(Case(context=(700, 45), new=(1, 1), num_heads=8, num_kv_heads=2, seed=23), kernel_device,
             launch=launch, state=state)
    fused = segments <= FUSED_MERGE_MAX_SEGMENTS
    assert recorder.names.count("_merge_segments_kernel") == (0 if fused else 1), recorder.names


def test_merge_counters_are_never_made_inside_a_graph_capture(monkeypatch) -> None:
    """The counters must be zero when a launch starts: made inside a capture, their zeroing would be recorded and
    replayed, so there the launch merges in a second kernel instead (None); likewise past the buffer or switched off."""
    cuda = torch.device("cuda", 0)
    state = PagedLaunchState()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert state.merge_counters(cuda, 8) is None and state.counters == {}
    cpu = torch.device("cpu")
    counters = state.merge_counters(cpu, 8)
    assert counters is not None and counters.dtype == torch.int32 and int(counters.count_nonzero()) == 0
    assert state.merge_counters(cpu, 8) is counters, "one buffer per device"
    assert state.merge_counters(cpu, state.merge_counter_slots + 1) is None
    state.merge_in_kernel = False
    assert state.merge_counters(cpu, 8) is None


def test_planned_split_kv_call_merges_in_kernel(kernel_device: torch.device) -> None:
    """The planned path (the second call of a step shape, launched per layer) with the fused merge: tables wide
    enough that the tiling splits the key range (the graphs' case: a bucket's full table width)."""
    state = PagedLaunchState(merge_in_kernel=True)
    step = make_step(Case(context=(40, 3), new=(1, 1), num_heads=8, num_kv_heads=2, seed=22), kernel_device)
    width = 4096 // 16  # 4096 keys: split on any device (the interpreter counts 4 SMs, an H200 132)
    tables = torch.zeros(2, width, dtype=torch.int32, device=kernel_device)
    tables[:, : step.block_tables.shape[1]] = step.block_tables
    args = (tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    sm = planning._device_sm_count(kernel_device)
    assert plan_paged_launch(2, 2, 2, 4, width * 16, sm, interpret=kernel_device.type != "cuda").num_segments > 1
    ref_out, _ = paged_attention_ref(step.q.cpu(), step.k.cpu(), step.v.cpu(), step.kv_cache.cpu().clone(),
                                     *(a.cpu() for a in args), **step.attrs)
    for _ in range(3):  # plans on the first call, launches the plan on the next (the same k/v are rewritten)
        out, _ = paged_attention_triton(step.q, step.k, step.v, step.kv_cache, *args, **step.attrs, state=state)
        torch.testing.assert_close(out.cpu(), ref_out, **tolerance(torch.float32))
    (plan,) = state.plans.values()
    assert plan.calls == 2 and plan.merge is None and plan.counters is not None
    assert int(plan.counters.count_nonzero()) == 0


def test_write_kv_matches_reference_and_skips_dropped_slots(kernel_device: torch.device) -> None:
    step = make_step(Case(context=(3, 0), new=(6, 2), dropped_slots=3, seed=12), kernel_device)
    expected = step.kv_cache.cpu().clone()
    write_kv(step.k.cpu(), step.v.cpu(), expected, step.slot_mapping.cpu())
    write_kv_triton(step.k, step.v, step.kv_cache, step.slot_mapping)
    torch.testing.assert_close(step.kv_cache.cpu(), expected, equal_nan=True, atol=0, rtol=0)


def test_copy_blocks_matches_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(13)
    caches = [torch.randn(6, 2, 2, 4, 8, generator=gen).to(kernel_device) for _ in range(3)]
    expected = [c.cpu().clone() for c in caches]
    pairs = torch.tensor([[1, 4], [2, 5], [4, 3]], dtype=torch.int64)  # block 4 is read before it is written
    copy_blocks_ref(expected, pairs)
    copy_blocks_triton(caches, pairs.to(kernel_device))
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)


@pytest.mark.gpu
@requires_cuda
def test_copy_blocks_kernel_copies_every_layer_in_one_launch() -> None:
    """Disjoint sources and destinations (copy-on-write) take the single-launch kernel path."""
    gen = torch.Generator().manual_seed(14)
    caches = [torch.randn(40, 2, 4, 16, 80, generator=gen).half().cuda() for _ in range(5)]
    expected = [c.cpu().clone() for c in caches]
    pairs = torch.tensor([[3, 30], [7, 31], [3, 32], [12, 2]], dtype=torch.int64)
    copy_blocks_ref(expected, pairs)
    copy_blocks_triton(caches, pairs.cuda())
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)


def test_launch_plan_depends_on_shapes_only() -> None:
    decode_long = plan_paged_launch(1, 1, 8, 4, 32768, sm_count=132)
    assert decode_long.num_segments > 1, "one long sequence must be split over the key range"
    decode_wide = plan_paged_launch(64, 64, 8, 4, 4096, sm_count=132)
    assert decode_wide.num_segments == 1 and decode_wide.block_q * 4 == 16
    prefill = plan_paged_launch(8192, 4, 8, 4, 4096, sm_count=132)
    assert prefill.num_segments == 1 and prefill.block_q * 4 == 128
    # FP8 pools (half the bytes a key): longer programs in 128-key tiles, the H200 sweep's best at these shapes
    fp8_long = plan_paged_launch(1, 1, 8, 4, 32768, sm_count=132, kv_bytes=1)
    assert (fp8_long.num_segments, fp8_long.tile_n) == (32, 128)
    assert (decode_long.num_segments, decode_long.tile_n) == (64, 32)
    fp8_mid = plan_paged_launch(16, 16, 8, 4, 8192, sm_count=132, kv_bytes=1)
    assert (fp8_mid.num_segments, fp8_mid.tile_n) == (2, 128)
    assert plan_paged_launch(64, 64, 8, 4, 4096, sm_count=132, kv_bytes=1) == decode_wide


def test_rejects_bad_inputs(kernel_device: torch.device) -> None:
    step = make_step(CASES["decode_mha"], kernel_device)
    args = (step.q, step.k, step.v, step.kv_cache, step.block_tables, step.seq_lens, step.query_start_loc)
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_attention_triton(*args, step.slot_mapping.int(), **step.attrs)
    with pytest.raises(ValueError, match="num_heads"):
        paged_attention_triton(*args, step.slot_mapping, **{**step.attrs, "num_heads": 3})
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_triton(*args, step.slot_mapping, **{**step.attrs, "sliding_window": -1})


# ---- GPU sweep: half precision, every GQA ratio, block sizes, long contexts (run with `pytest -m gpu`) ----------
GPU_SWEEP = [
    Case(context=ctx, new=new, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt, seed=i,
         sliding_window=win, alibi=alibi, dropped_slots=drop)
    for i, (ctx, new, hq, hkv, d, bs, dt, win, alibi, drop) in enumerate([
        ((0, 0, 0), (129, 300, 1), 32, 8, 128, 16, torch.bfloat16, 0, False, 0),
        ((1000, 2047, 5, 77), (1, 1, 1, 1), 32, 8, 128, 16, torch.float16, 0, False, 0),
        ((3000,), (1,), 32, 8, 128, 32, torch.bfloat16, 0, False, 0),
        ((0, 513, 250, 31), (257, 64, 1, 3), 16, 16, 64, 64, torch.bfloat16, 0, False, 5),
        ((777, 0), (200, 50), 28, 4, 128, 16, torch.float16, 0, False, 0),
        ((100, 2000, 0), (1, 33, 90), 24, 24, 80, 32, torch.float16, 0, True, 0),
        ((4000, 10), (1, 100), 16, 2, 64, 16, torch.bfloat16, 256, False, 0),
        ((2500,), (1,), 12, 12, 64, 16, torch.float32, 100, True, 0),
        ((65, 0, 1), (70, 190, 1), 14, 2, 64, 64, torch.float32, 0, False, 2),
        ((16384,), (1,), 32, 8, 128, 16, torch.bfloat16, 0, False, 0),
    ])
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_SWEEP, ids=[f"sweep{i}" for i in range(len(GPU_SWEEP))])
def test_gpu_sweep_matches_reference(case: Case) -> None:
    run_both(case, torch.device("cuda"))


# ---- RoPE fused into the KV write (the torch executor's fuse_rope_into_paged_attention) -----------------------------
def rope_tables(case: Case, device: torch.device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, 1, T, D] of each new token's absolute position (HF's rotary tables), in the case's dtype."""
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(case.context, case.new)]).float()
    inv_freq = base ** (-torch.arange(0, case.head_dim, 2).float() / case.head_dim)
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat((angles, angles), -1)[None, None]
    return emb.cos().to(device, case.dtype), emb.sin().to(device, case.dtype)


def run_rope_fused(case: Case, device: torch.device, launch: PagedLaunch | None = None) -> None:
    """paged_attention_triton(rope_cos=, rope_sin=) against rope_triton on q and k and the plain op: the output and
    the whole pool (NaN poison included) bit for bit; and the torch reference of the unfused ops within tolerance."""
    step = make_step(case, device)
    cos, sin = rope_tables(case, device)
    args = (step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    unfused_cache = step.kv_cache.clone()
    want, _ = paged_attention_triton(rope_triton(step.q, cos, sin), rope_triton(step.k, cos, sin), step.v,
                                     unfused_cache, *args, alibi_slopes=step.alibi_slopes, launch=launch, **step.attrs)
    got, got_cache = paged_attention_triton(step.q, step.k, step.v, step.kv_cache, *args, rope_cos=cos, rope_sin=sin,
                                            alibi_slopes=step.alibi_slopes, launch=launch, **step.attrs)
    assert got_cache is step.kv_cache
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_cache, unfused_cache, equal_nan=True, atol=0, rtol=0)
    ref_cache = make_step(case, torch.device("cpu")).kv_cache
    c, s = cos.cpu(), sin.cpu()
    slopes = None if step.alibi_slopes is None else step.alibi_slopes.cpu()
    ref, _ = paged_attention_ref(rope_ref(step.q.cpu(), c, s), rope_ref(step.k.cpu(), c, s), step.v.cpu(), ref_cache,
                                 *(a.cpu() for a in args), alibi_slopes=slopes, **step.attrs)
    torch.testing.assert_close(got.cpu().float(), ref.float(), **tolerance(case.dtype))


ROPE_CASES = ["decode_gqa4_bs32", "mixed_step", "head_dim_80", "dropped_slots", "prefill_gqa2", "decode_mha"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)  # bf16 attention: the GPU sweep
@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_fused_into_the_kv_write_is_bit_identical(name: str, dtype: torch.dtype,
                                                       kernel_device: torch.device) -> None:
    run_rope_fused(dataclasses.replace(CASES[name], dtype=dtype), kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rope_write_kv_returns_rotated_q_and_skips_dropped_slots(dtype: torch.dtype,
                                                                 kernel_device: torch.device) -> None:
    """The rotation shares rope/kernel.py's code, so it is rope_triton's bit for bit in every dtype (the interpreter
    truncates bf16 where the GPU rounds, but it does so in both kernels alike; the GPU sweep checks the GPU)."""
    case = Case(context=(3, 0), new=(6, 2), dropped_slots=3, seed=15, num_heads=6, num_kv_heads=2, dtype=dtype)
    step = make_step(case, kernel_device)
    cos, sin = rope_tables(case, kernel_device)
    expected = step.kv_cache.clone()
    write_kv_triton(rope_triton(step.k, cos, sin), step.v, expected, step.slot_mapping)
    q_rot = rope_write_kv_triton(step.q, step.k, step.v, cos, sin, step.kv_cache, step.slot_mapping)
    assert q_rot.is_contiguous() and q_rot.shape == step.q.shape
    torch.testing.assert_close(q_rot, rope_triton(step.q, cos, sin), atol=0, rtol=0)
    torch.testing.assert_close(step.kv_cache, expected, equal_nan=True, atol=0, rtol=0)


def test_rope_write_kv_refuses_tables_it_cannot_broadcast(kernel_device: torch.device) -> None:
    step = make_step(CASES["mixed_step"], kernel_device)
    cos, sin = rope_tables(CASES["mixed_step"], kernel_device)
    args = (step.q, step.k, step.v)
    with pytest.raises(ValueError, match="broadcast"):  # one table per head: not what the kernel reads
        rope_write_kv_triton(*args, cos.expand(1, 4, -1, -1).contiguous() * 1, sin, step.kv_cache,
                             step.slot_mapping)
    with pytest.raises(ValueError, match="dtype"):
        rope_write_kv_triton(*args, cos.double(), sin, step.kv_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="both or neither"):
        paged_attention_triton(*args, step.kv_cache, step.block_tables, step.seq_lens, step.query_start_loc,
                               step.slot_mapping, rope_cos=cos, **step.attrs)


ROPE_GPU_SWEEP = [GPU_SWEEP[i] for i in (0, 1, 3, 4, 5, 8, 9)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ROPE_GPU_SWEEP, ids=[f"sweep{i}" for i in range(len(ROPE_GPU_SWEEP))])
def test_gpu_sweep_rope_fused_is_bit_identical(case: Case) -> None:
    run_rope_fused(case, torch.device("cuda"))
