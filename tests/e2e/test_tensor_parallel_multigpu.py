"""Tensor parallelism on two and four GPUs of one host: `pytest -m multigpu tests/e2e` on nvidia-h200-x2 or x4.

The same checks as the CPU tests (tests/runtime/test_tensor_parallel.py, gloo), on CUDA with NCCL, with decode steps
replayed from CUDA graphs on every rank (the all-reduce captured inside them):

- fp32: tiny Llama (GQA 4/2) and tiny Qwen2 (MQA 4/1: the KV head replicated) at N = 2 and N = 4 (KV heads
  replicated over the ranks beyond their count) equal HF `generate` token for token, as the single-GPU e2e tests
  require, with NCCL's all-reduce and with the peer-to-peer one (TRTOPT_ALL_REDUCE=p2p: one-shot / two-shot over
  symmetric memory, docs/architecture.md §7b; `p2p` fails at start-up rather than fall back);
- bf16: within the e2e tolerances of HF bf16 (tests/e2e/test_gpu_e2e.py: BF16_LOGPROB_ATOL, BF16_TIE_MARGIN);
- a worker killed mid-generation ends the engine with WorkerDiedError in bounded time (the monitor aborts the NCCL
  group so rank 0's collective returns).

Both with the replicated LM head and with the vocabulary-parallel one (`--lm-head vocab-parallel`: the NCCL
all-gather of the sampled logits rows captured in the graphs too).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from test_gpu_e2e import (
    BF16_LOGPROB_ATOL, BF16_TIE_MARGIN, GREEDY, LIMITS, PROMPTS, assert_equal_to_hf, first_divergence, hf_for,
    hf_greedy, hf_logits, outputs_by_prompt,
)
from trtopt.errors import WorkerDiedError
from trtopt.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host (nvidia-h200-x2)"),
]
FOUR = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs of one host (nvidia-h200-x4)")
SIZES = [2, pytest.param(4, marks=FOUR)]
__all__ = ["hf_for"]  # the fixture, re-exported for pytest


@pytest.fixture(scope="module")
def tp_plan(tmp_path_factory):
    """tp_plan(model, dtype, lm_head, tp) -> a plan sharded for `tp` ranks, from a fresh export of the model in
    `dtype` (one export per (model, dtype), one build per LM-head layout and size)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.export import export_model

    exports: dict[tuple[str, str], Path] = {}
    cache: dict[tuple[str, str, str, int], Path] = {}

    def get(model: str, dtype: str, lm_head: str = "replicated", tp: int = 2) -> Path:
        if (model, dtype) not in exports:
            root = tmp_path_factory.mktemp(f"tp-{model}-{dtype}")
            exports[(model, dtype)] = export_model(model, root / "export", dtype=dtype, force=True,
                                                   verify_outputs=dtype != "bf16").out_dir
        key = (model, dtype, lm_head, tp)
        if key not in cache:
            plan = exports[(model, dtype)].parent / f"plan-{lm_head}-tp{tp}"
            cache[key] = build_plan(exports[(model, dtype)], plan, limits=LIMITS, force=True, progress=False,
                                    tensor_parallel=tp, lm_head=lm_head).plan_dir
        return cache[key]

    return get


def tp_llm(plan_dir: Path, tp: int = 2):
    from trtopt import LLM

    return LLM(plan_dir, device="cuda", tensor_parallel_size=tp)


@pytest.mark.parametrize("all_reduce", ["nccl", "p2p"])
@pytest.mark.parametrize("tp", SIZES)
@pytest.mark.parametrize("lm_head", ["replicated", "vocab-parallel"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_fp32_equal_hf_with_cuda_graphs(model, lm_head, tp, all_reduce, tp_plan, hf_for, monkeypatch):
    from trtopt.runtime.executors.all_reduce import ALL_REDUCE_ENV

    monkeypatch.setenv(ALL_REDUCE_ENV, all_reduce)  # read by every rank at start-up (workers inherit it)
    with tp_llm(tp_plan(model, "fp32", lm_head, tp), tp) as llm:
        graphs = llm.engine.executor.graphs  # rank 0's; every rank captured the same buckets
        assert graphs is not None and graphs.enabled and graphs._captured  # the all-reduces captured inside
        assert (llm.engine.executor._all_reduce is not None) == (all_reduce == "p2p")  # the path asked for is taken
        outs = llm.generate(PROMPTS, GREEDY)
        assert graphs.enabled  # no capture failed and turned replay off
    hf32 = hf_for(model, "fp32")
    prompt_ids, _ = outputs_by_prompt(outs)
    assert_equal_to_hf(model, outs, hf_greedy(hf32, prompt_ids), hf32)


@pytest.mark.parametrize("tp", SIZES)
@pytest.mark.parametrize("lm_head", ["replicated", "vocab-parallel"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_bf16_within_tolerance_of_hf(model, lm_head, tp, tp_plan, hf_for):
    with tp_llm(tp_plan(model, "bf16", lm_head, tp), tp) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    hf_half, hf32 = hf_for(model, "bf16"), hf_for(model, "fp32")
    prompt_ids, ours_all = outputs_by_prompt(outs)
    refs = hf_greedy(hf_half, prompt_ids)
    worst_lp, ties = 0.0, []
    for i, out in enumerate(outs):
        ours, ref = ours_all[i], refs[i]
        lp = torch.log_softmax(hf_logits(hf_half, out.prompt_token_ids + ours), -1)[len(out.prompt_token_ids) - 1:-1]
        got = torch.tensor([d[t] for d, t in zip(out.outputs[0].logprobs, ours)])
        want = lp[torch.arange(len(ours)), torch.tensor(ours, device=lp.device)].cpu()
        worst_lp = max(worst_lp, float((got - want).abs().max()))
        j = first_divergence(ours, ref)
        if j is not None:
            row = hf_logits(hf32, out.prompt_token_ids + ref[:j])[-1]
            margin = float(row[ref[j]] - row[ours[j]])
            ties.append((i, j, round(margin, 4)))
            assert margin <= BF16_TIE_MARGIN, f"{model} prompt {i}: departs from HF bf16 at {j} by {margin:.4g}"
    print(f"\n[tp={tp} bf16 {model} {lm_head}] max |logprob - HF bf16| = {worst_lp:.4g}; near-tie divergences {ties}")
    assert worst_lp <= BF16_LOGPROB_ATOL


@pytest.mark.parametrize("lm_head", ["replicated", "vocab-parallel"])
def test_killed_worker_ends_the_engine_over_nccl(lm_head, tp_plan):
    llm = tp_llm(tp_plan("tiny-llama", "fp32", lm_head))
    worker = llm.engine.executor._workers[0]
    killed_at: list[float] = []

    def kill(out):
        if not killed_at and len(out.outputs[0].token_ids) == 3:
            os.kill(worker.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    try:
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            llm.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), on_output=kill)
        assert time.monotonic() - killed_at[0] < 30
    finally:
        llm.shutdown()
