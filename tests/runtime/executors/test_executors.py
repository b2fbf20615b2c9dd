"""The torch and onnxruntime executors on built plans: same logits as each other and as the original graph."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from trtopt.builder.plan import read_plan
from trtopt.check.compare import Tolerance
from trtopt.check.driver import BlockSource, Seq, make_step
from trtopt.check.original import OriginalModel
from trtopt.check.runner import Workload, compare_executors
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.executors import create_executor
from trtopt.runtime.executors.ort_executor import OrtExecutor
from trtopt.runtime.executors.torch_executor import TorchExecutor

NUM_BLOCKS = 24
ATOL = 1e-4


def prompts(vocab: int, lens=(21, 6, 1)) -> list[list[int]]:
    rng = np.random.default_rng(sum(lens))
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def generate_and_compare(plan_dir, export_dir, executors, *, chunk=8, decode_steps=4) -> dict[str, float]:
    """Packed greedy generation (trtopt check's driver); returns max |Δlogits| over every scheduled row of each
    executor vs the original graph on onnxruntime, one sequence at a time with past KV."""
    plan = read_plan(plan_dir)
    original = OriginalModel(export_dir / "model.onnx", plan.model)
    workload = Workload(tuple(map(tuple, prompts(plan.model.vocab_size))), chunk=chunk, decode_steps=decode_steps)
    results = compare_executors(plan, executors, workload, Tolerance(atol=ATOL, rtol=0.0), original=original)
    for name in executors:
        assert results[name].logits.elements > 0 and results[name].greedy_tokens, name
    return {name: results[name].logits.max_abs for name in executors}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_executors_match_original_graph(model, exporter, plan_dir, export_dir):
    """Chunked prefill + prefill + decode rows of three sequences packed in each step, then decodes."""
    built = plan_dir(model, exporter)
    plan = read_plan(built)
    executors = {
        "torch": create_executor("torch", built, plan, num_blocks=NUM_BLOCKS),
        "onnxruntime": create_executor("onnxruntime", built, plan, num_blocks=NUM_BLOCKS),
    }
    worst = generate_and_compare(built, export_dir(model, exporter), executors)
    assert worst["torch"] <= ATOL and worst["onnxruntime"] <= ATOL, worst


def test_function_body_path_matches_reference_path(plan_dir, export_dir):
    """PagedAttention inlined from its ONNX body (kv_cache_out a new tensor, copied back) == the torch op."""
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    by_op = TorchExecutor(built, plan)
    by_body = TorchExecutor(built, plan, body_ops=("PagedAttention", "RMSNorm", "MatMulAdd"))
    assert not any("paged_attention" in str(n.target) for n in by_body.graph.module.graph.nodes)
    for ex in (by_op, by_body):
        ex.allocate_kv_cache(NUM_BLOCKS)
    worst = generate_and_compare(built, export_dir("tiny-llama"), {"op": by_op, "body": by_body})
    assert worst["op"] <= ATOL and worst["body"] <= ATOL, worst
    for a, b in zip(by_op.kv_caches, by_body.kv_caches):
        # The body redirects skipped writes to the null block 0; every real block must agree.
        torch.testing.assert_close(a[1:], b[1:], atol=ATOL, rtol=0)


def test_torch_pools_are_written_in_place_and_skip_slot_minus_one(plan_dir):
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    ex = TorchExecutor(built, plan)
    ex.allocate_kv_cache(8)
    pools = list(ex.kv_caches)
    step = make_step([Seq([5, 6, 7])], [3], plan.limits.block_size, BlockSource(8))  # block 1, slots 16..18
    step.slot_mapping[1] = -1  # the middle token's K/V is not written
    ex.execute(step)
    assert all(a is b for a, b in zip(pools, ex.kv_caches))
    bs = plan.limits.block_size
    for pool in ex.kv_caches:
        per_slot = pool.permute(0, 3, 1, 2, 4).reshape(8 * bs, -1)  # [slot, K/V · Hkv · D]
        written = per_slot.abs().sum(dim=1) > 0
        assert written.nonzero().flatten().tolist() == [1 * bs + 0, 1 * bs + 2]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_copy_blocks_forks_a_sequence(backend, plan_dir):
    """A sequence whose blocks are copies (copy-on-write) decodes exactly like the original."""
    built = plan_dir("tiny-qwen2")
    plan = read_plan(built)
    ex = create_executor(backend, built, plan, num_blocks=NUM_BLOCKS)
    bs = plan.limits.block_size
    source = BlockSource(NUM_BLOCKS)
    parent = Seq(prompts(plan.model.vocab_size, lens=(bs + 5,))[0])
    ex.execute(make_step([parent], [len(parent.tokens)], bs, source))
    child = Seq(list(parent.tokens), cached=parent.cached, blocks=[source.take() for _ in parent.blocks])
    ex.copy_blocks(list(zip(parent.blocks, child.blocks)))
    for seq in (parent, child):
        seq.tokens.append(3)
    logits = ex.execute(make_step([parent, child], [1, 1], bs, source))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)  # one batch, two rows: not bit-equal


def test_factory_and_executor_errors(plan_dir, tmp_path):
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    with pytest.raises(ConfigError, match="unknown backend 'jax'"):
        create_executor("jax", built, plan)
    with pytest.raises(ConfigError, match="num_blocks must be >= 2"):
        create_executor("torch", built, plan, num_blocks=1)
    with pytest.raises(ConfigError, match="built in float32"):
        TorchExecutor(built, plan, dtype=torch.float16)
    with pytest.raises(ConfigError, match="not available"):
        OrtExecutor(built, plan, providers=["NoSuchExecutionProvider"])
    # A plan.json that disagrees with its graph (one layer too many) is refused by both executors.
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    data = json.loads((broken / "plan.json").read_text())
    data["model"]["num_layers"] += 1
    (broken / "plan.json").write_text(json.dumps(data))
    for backend in ("torch", "onnxruntime"):
        with pytest.raises(BuildError, match=r"missing inputs \['kv_cache\.\d+'\]"):
            create_executor(backend, broken, read_plan(broken))


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_logits_can_be_modified_in_place_by_the_caller(backend, plan_dir):
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    ex = create_executor(backend, built, plan, num_blocks=8)
    logits = ex.execute(make_step([Seq([4, 5, 6])], [3], plan.limits.block_size, BlockSource(8)))
    logits[0, 0] = -1.0  # a sampler applying a penalty
    logits.sub_(1.0)
    assert float(logits[0, 0]) == -2.0
