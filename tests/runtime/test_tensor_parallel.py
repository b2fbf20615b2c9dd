"""Tensor parallelism on CPU (gloo): LLM(plan, tensor_parallel_size=2) drives a worker process per extra rank.

Greedy tokens at N = 2 equal HF generate (and so N = 1) on tiny Llama (GQA 4/2: one KV head per rank) and tiny Qwen2
(MQA 4/1 with QKV bias and tied embeddings: the KV head replicated on both ranks); a seeded n=2 request (KV blocks
copied on write through the workers) equals the single-rank engine; a killed worker ends the engine with
WorkerDiedError within seconds. With the vocabulary-parallel LM head (each rank projects its vocabulary columns and
trtopt.AllGather joins the sampled rows) greedy tokens equal HF too: tiny Llama (untied), tiny Qwen2 (tied) and a
tied Llama with GPT-2's odd 50257-token vocabulary (the last shard padded).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, rank_dir, read_plan
from trtopt.errors import WorkerDiedError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.tensor_parallel import _Command, _from_wire, _to_wire
from trtopt.runtime.llm import LLM
from trtopt.runtime.sampling_params import SamplingParams

LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=128)
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_llm(export_dir, odd_vocab_model, module_tmp):
    """tp_llm(model, lm_head) -> an LLM over the model's plan sharded for 2 ranks ("odd-vocab": odd_vocab_model's).
    A process joins one torch.distributed group at a time, so asking for another plan shuts the current engine
    down (the tests are ordered by plan)."""
    current: dict[tuple[str, str], LLM] = {}

    def get(model: str, lm_head: str = "replicated") -> LLM:
        if (model, lm_head) not in current:
            for llm in current.values():
                llm.shutdown()
            current.clear()
            out = module_tmp / f"tp2-{model}-{lm_head}"
            source = odd_vocab_model()[1] if model == "odd-vocab" else export_dir(model)
            build_plan(source, out, limits=LIMITS, force=True, progress=False, tensor_parallel=2, lm_head=lm_head)
            current[(model, lm_head)] = LLM(out, tensor_parallel_size=2)
        return current[(model, lm_head)]

    yield get
    for llm in current.values():
        llm.shutdown()
    assert not dist.is_initialized()


def assert_greedy_equals_hf(llm: LLM, model, hf_model) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    for out in outs:
        x = torch.tensor([out.prompt_token_ids])
        ref = hf_model(model).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12,
                                       do_sample=False)
        assert out.outputs[0].token_ids == ref[0, x.shape[1]:].tolist()


def test_llama_greedy_at_two_ranks_equals_hf(tp_llm, hf_model):
    """GQA 4/2: each rank holds 2 query heads and its own KV head."""
    assert_greedy_equals_hf(tp_llm("tiny-llama"), "tiny-llama", hf_model)


def test_seeded_n2_with_copy_on_write_equals_one_rank(tp_llm, engine_for):
    prompt = "Once upon a time there was a"  # 8 tokens: the two completions share a partly filled block
    params = SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    llm = tp_llm("tiny-llama")
    llm.engine.pool.reset_prefix_cache()
    got = llm.generate(prompt, params)[0]
    assert llm.engine.kv.num_cow_copies >= 1
    single = engine_for("tiny-llama", max_model_len=128, enable_prefix_caching=False)
    single.add_request("one", prompt, params)
    while single.has_unfinished_requests():
        for out in single.step():
            if out.finished:
                expected = out
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "odd-vocab"])
def test_vocab_parallel_head_greedy_at_two_ranks_equals_hf(model, tp_llm, hf_model, odd_vocab_model):
    """Each rank projects half the vocabulary (odd-vocab: 25129 columns, rank 1's last one padding); the driver
    samples from the gathered full rows."""
    llm = tp_llm(model, "vocab-parallel")
    assert llm.engine.executor.plan.parallel.lm_head == "vocab-parallel"
    hf = str(odd_vocab_model()[0]) if model == "odd-vocab" else model
    assert_greedy_equals_hf(llm, hf, hf_model)


def test_qwen2_greedy_at_two_ranks_equals_hf(tp_llm, hf_model):
    """MQA 4/1 with QKV bias and tied embeddings: the one KV head is replicated on both ranks."""
    assert_greedy_equals_hf(tp_llm("tiny-qwen2"), "tiny-qwen2", hf_model)


def test_killed_worker_ends_the_engine_with_a_clear_error(tp_llm):
    llm = tp_llm("tiny-qwen2")
    worker = llm.engine.executor._workers[0]
    killed_at: list[float] = []

    def kill_after_three_tokens(out):
        if not killed_at and len(out.outputs[0].token_ids) == 3:
            os.kill(worker.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        llm.generate("Hello", params, on_output=kill_after_three_tokens)
    assert time.monotonic() - killed_at[0] < 15
    assert not llm.engine.has_unfinished_requests()  # the request was failed, its blocks freed
    assert llm.engine.stats().num_blocks_free == llm.engine.stats().num_blocks_total
    with pytest.raises(WorkerDiedError):  # and the engine stays stopped
        llm.generate("Hello", GREEDY)
    assert not dist.is_initialized()  # the driver left the group


def _step(num_tokens: int, num_seqs: int, width: int, sampled: int | None) -> StepInputs:
    g = torch.Generator().manual_seed(num_tokens * 131 + width)
    return StepInputs(
        input_ids=torch.randint(-4, 1000, (1, num_tokens), generator=g),
        position_ids=torch.randint(0, 128, (1, num_tokens), generator=g),
        block_tables=torch.randint(0, 64, (num_seqs, width), dtype=torch.int32, generator=g),
        seq_lens=torch.randint(1, 128, (num_seqs,), dtype=torch.int32, generator=g),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        slot_mapping=torch.randint(-1, 1024, (num_tokens,), generator=g),
        logits_indices=torch.arange(min(num_seqs, num_tokens)),
        sampled_ids=None if sampled is None else torch.arange(sampled),
    )


@pytest.mark.parametrize("shape", [(1, 1, 13, 1), (7, 3, 5, None), (0, 0, 0, 0), (300, 256, 128, 256)],
                         ids=["decode", "odd-int32-widths", "empty", "large"])
def test_a_step_crosses_the_wire_unchanged(shape):
    """The driver's step message (tensor_parallel._to_wire: one bytes object, not pickled arrays) gives the worker
    the same tensors, dtypes and shapes, writable, and the sampled ids' count (the ids follow by broadcast)."""
    step = _step(*shape)
    if shape[2] > 1:  # a transposed (non-contiguous) block table travels in C order too
        step = dataclasses.replace(step, block_tables=step.block_tables.t().contiguous().t())
    got = _from_wire(pickle.loads(pickle.dumps(_to_wire(_Command("step", step)))))
    assert got.op == "step"
    for field in dataclasses.fields(StepInputs):
        want, have = getattr(step, field.name), getattr(got.arg, field.name)
        if field.name == "sampled_ids":
            assert (have is None) == (want is None) and (want is None or have.shape == want.shape)
            continue
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), field.name
    got.arg.input_ids.add_(1)  # the worker's own tensors
    other = _from_wire(_to_wire(_Command("alloc", 12)))
    assert (other.op, other.arg) == ("alloc", 12)


def _gather_on_rank(rank: int, store_path: str, out_dir: str) -> None:
    from trtopt.plugins.all_gather.reference import all_gather_ref

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank  # rank r's block: values + 100 r
        for axis in (0, 1, -1):
            torch.save(all_gather_ref(x, world_size=2, axis=axis), f"{out_dir}/rank{rank}_axis{axis}.pt")
    finally:
        dist.destroy_process_group()


def test_all_gather_torch_face_puts_rank_blocks_side_by_side_along_the_axis(tmp_path):
    """The torch face over gloo at N = 2: every rank gets torch.cat of the ranks' blocks along `axis`, in rank
    order (the all-gather fills dim 0; the face rearranges), for the first, a middle and the last axis."""
    import torch.multiprocessing as mp

    mp.spawn(_gather_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    blocks = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r for r in range(2)]
    for axis in (0, 1, -1):
        want = torch.cat(blocks, dim=axis)
        for rank in range(2):
            assert torch.equal(torch.load(tmp_path / f"rank{rank}_axis{axis}.pt"), want), (rank, axis)



class _GlooSum:
    """The P2P all-reduce's contract (a new tensor holding the sum over the group; None for a message it leaves to
    NCCL), over gloo: the one-shot CUDA kernel does not run on the CPU."""

    def __init__(self, max_numel: int) -> None:
        self.max_numel = max_numel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.numel() > self.max_numel:
            return None
        out = x.clone()
        dist.all_reduce(out)
        return out


def _share_ids_on_rank(rank: int, store_path: str, out_dir: str) -> None:
    from types import SimpleNamespace

    from trtopt.runtime.executors.tensor_parallel import _share_sampled_ids

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        results = {}
        for vocab, ids, max_numel in [(49152, [0, 49151, 7, 2**20], 64),  # the sum path
                                      (49152, list(range(100)), 64),  # too long for the fast kernels: broadcast
                                      (2**24 + 2, [2**24 + 1, 3], 64)]:  # beyond float32's integers: broadcast
            buffer = torch.full((len(ids),), -1, dtype=torch.int64)  # a worker's graphs' buffer
            executor = SimpleNamespace(device=torch.device("cpu"), plan=SimpleNamespace(
                model=SimpleNamespace(vocab_size=vocab)), graphs=SimpleNamespace(sampled_ids_buffer=lambda n: buffer))
            sampled = torch.tensor(ids) if rank == 0 else torch.empty(len(ids), dtype=torch.int64)
            step = StepInputs(**{f.name: None for f in dataclasses.fields(StepInputs) if f.name != "sampled_ids"},
                              sampled_ids=sampled)
            got = _share_sampled_ids(step, executor, sender=rank == 0, fast=_GlooSum(max_numel)).sampled_ids
            assert rank == 0 or got is buffer  # a worker's ids land in its graphs' buffer
            results[vocab, len(ids)] = got.tolist()
        torch.save(results, f"{out_dir}/ids_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sampled_ids_shared_through_the_fast_all_reduce_are_rank_0s_exactly(tmp_path):
    """With the P2P all-reduce the ids travel as a float32 sum (rank 0's ids, zeros elsewhere): every rank gets rank
    0's ids exactly, up to the largest id; a message the fast path declines, or ids past 2^24, take the broadcast."""
    import torch.multiprocessing as mp

    mp.spawn(_share_ids_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    want = {(49152, 4): [0, 49151, 7, 2**20], (49152, 100): list(range(100)), (2**24 + 2, 2): [2**24 + 1, 3]}
    for rank in range(2):
        assert torch.load(tmp_path / f"ids_rank{rank}.pt") == want, rank


def test_async_scheduling_at_two_ranks_resolves_placeholders_on_every_rank(tp_llm, export_dir, module_tmp, hf_model):
    """Async scheduling (off by default on the CPU, on for CUDA): each step's input ids hold placeholders for the
    previous step's tokens, which the driver sends its workers by broadcast (tensor_parallel._share_sampled_ids);
    a worker that filled them wrongly would run another token through its half of every layer and the greedy tokens
    would leave HF's. A seeded n=2 request (two rows of sampled ids, copy-on-write) equals the synchronous loop's."""
    prompt = "Once upon a time there was a"
    seeded = SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    sync = tp_llm("tiny-llama")  # the synchronous loop over the same sharded plan
    want = [c.token_ids for c in sync.generate(prompt, seeded)[0].outputs]
    sync.shutdown()  # one torch.distributed group per process
    out = module_tmp / "tp2-tiny-llama-async"
    build_plan(export_dir("tiny-llama"), out, limits=LIMITS, force=True, progress=False, tensor_parallel=2)
    llm = LLM(out, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert llm.engine.async_scheduling and llm.engine.executor.resolves_placeholders
        assert_greedy_equals_hf(llm, "tiny-llama", hf_model)
        assert [c.token_ids for c in llm.generate(prompt, seeded)[0].outputs] == want
    finally:
        llm.shutdown()


# --kv-cache-smoothing with tensor parallelism: each rank keeps the calibrated means of its KV heads.

SMOOTHED = dict(kv_cache_dtype="fp8", kv_cache_smoothing="kv")


def _smoothed_plans(model: str, source, out, sizes) -> dict:
    """size (None: unsharded) -> the plan dir of ``source`` built with FP8 pools and K/V smoothing."""
    from trtopt.runtime.kv_calibration import kv_stats

    return {n: build_plan(source, out / f"smooth-{model}-tp{n}", limits=LIMITS, force=True, progress=False,
                          tensor_parallel=n, kv_calibrator=kv_stats, **SMOOTHED).plan_dir for n in sizes}


def _smoothing_constants(plan_dir) -> dict:
    """The smoothing means of a plan's model.onnx: name (less the per-rank suffix) -> array, and check that every
    PagedAttention's k and v are smoothed by the layer's own constant."""
    import onnx
    from onnx import numpy_helper

    from trtopt.builder.sharding import SHARD_SUFFIX
    from trtopt.fusion_passes.kv_smoothing import INITIALIZER_PREFIX

    graph = onnx.load(str(plan_dir / "model.onnx")).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    for layer, node in enumerate(n for n in graph.node if n.op_type == "PagedAttention"):
        for i, what in ((1, "k"), (2, "v")):
            sub = produced_by[node.input[i]]
            assert sub.op_type == "Sub", (layer, what)
            assert sub.input[1].removesuffix(SHARD_SUFFIX) == f"{INITIALIZER_PREFIX}{what}_{layer}", (layer, what)
    return {t.name.removesuffix(SHARD_SUFFIX).removeprefix(INITIALIZER_PREFIX): numpy_helper.to_array(t)
            for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)}


def _assert_rank_slices(plans: dict, kv_heads: list[list[int]], heads: list[list[int]]) -> None:
    """Rank r's constants of the N = 2 plan equal the N = 1 plan's rows of its KV heads ``kv_heads[r]`` (k_l, v_l:
    [1, Hkv, 1, D]) and of its query heads ``heads[r]`` (v_out_l: [1, Hq, 1, D]), exactly."""
    import numpy as np

    full = _smoothing_constants(rank_dir(plans[1], 0))
    assert full
    for rank in range(2):
        got = _smoothing_constants(rank_dir(plans[2], rank))
        assert got.keys() == full.keys()
        for name, array in full.items():
            rows = heads[rank] if name.startswith("v_out_") else kv_heads[rank]
            assert np.array_equal(got[name], array[:, rows]), (rank, name)
    # The N = 1 rank graph is the unsharded graph the means were calibrated on (no horizontal Q/K/V fusion); the
    # unsharded plan fuses Q/K/V into one MatMul, so its means agree to rounding only.
    unsharded = _smoothing_constants(plans[None])
    assert unsharded.keys() == full.keys()
    for name, array in full.items():
        np.testing.assert_allclose(array, unsharded[name], rtol=1e-4, atol=1e-5)


def test_smoothing_means_shard_with_the_kv_heads_and_greedy_at_two_ranks_equals_unsharded(export_dir, module_tmp):
    """tiny Llama (GQA 4/2): rank r's means are row r of every [1, 2, 1, D] K/V mean and rows 2r, 2r + 1 of the
    per-query-head V mean added back; greedy tokens at N = 2 over gloo equal the unsharded smoothed plan's."""
    plans = _smoothed_plans("tiny-llama", export_dir("tiny-llama"), module_tmp, (None, 1, 2))
    _assert_rank_slices(plans, kv_heads=[[0], [1]], heads=[[0, 1], [2, 3]])
    with LLM(plans[None]) as single:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    assert not dist.is_initialized(), "another test's tensor-parallel engine still holds the process group"
    with LLM(plans[2], tensor_parallel_size=2) as llm:
        assert llm.engine.executor.plan.kv_cache_smoothing == "kv"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want


def test_smoothing_means_of_a_replicated_kv_head_are_on_every_rank(export_dir, module_tmp):
    """tiny Qwen2 (MQA 4/1): the one KV head is replicated, so both ranks keep its whole K and V means, and each
    its two query heads' rows of the V mean added back (that same head's mean)."""
    plans = _smoothed_plans("tiny-qwen2", export_dir("tiny-qwen2"), module_tmp, (None, 1, 2))
    _assert_rank_slices(plans, kv_heads=[[0], [0]], heads=[[0, 1], [2, 3]])
    assert read_plan(plans[2]).parallel.kv_heads_replicated
    for rank in range(2):
        means = _smoothing_constants(rank_dir(plans[2], rank))
        layers = [name.removeprefix("v_out_") for name in means if name.startswith("v_out_")]
        # each of the rank's two query heads adds the replicated head's mean: [1, 2, 1, D] against [1, 1, 1, D]
        assert layers and all((means[f"v_out_{i}"] == means[f"v_{i}"]).all() for i in layers)
