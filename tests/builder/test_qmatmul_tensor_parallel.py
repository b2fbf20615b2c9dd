"""`trtopt build --tensor-parallel N` on quantized plans (trtopt.QMatMul, docs/architecture.md §4 and §7b): q/k/v and
gate/up QMatMuls split their w_q / w_scale / w_zero_point by columns, o and down by rows (INT4 block scales by
whole blocks, or a FusionError naming the group sizes that work); a plan sharded for one rank equals the unsharded
plan on ORT; every rank's INT4 slice is the unsharded weight's; greedy tokens at two ranks (CPU, gloo) equal one
rank's (static FP8, INT4; per-token FP8 scales become per rank). Horizontal fusion stays off in tensor-parallel
builds, and the sharding refuses a concatenated QKV QMatMul (its Split)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch.distributed as dist
from onnx import numpy_helper

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, rank_dir, read_plan
from trtopt.builder.sharding import shard_structure
from trtopt.builder.sharding.analysis import LM_HEAD_REPLICATED
from trtopt.errors import FusionError
from trtopt.quantize import QuantizeConfig, quantize_model

LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=128)
CONFIGS = {
    "fp8_w8a8_static": dict(weights="fp8", activations="fp8", calibration_sequences=2, calibration_length=64),
    "fp8_w8a8_dynamic": dict(weights="fp8", activations="fp8", activation_scales="dynamic"),
    "int4_asym_g32": dict(weights="int4", group_size=32, asymmetric=True),
    "int4_sym_g64": dict(weights="int4", group_size=64),  # o_proj K = 64: 32 rows per rank split its blocks
}
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def quantized(export_dir, module_tmp):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = module_tmp / f"q-{name}"
            quantize_model(export_dir("tiny-llama"), cache[name], QuantizeConfig(**CONFIGS[name]), force=True)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def plan(quantized, module_tmp):
    """plan(name, size) -> the BuildResult of the quantized tiny-llama ``name`` (size None: unsharded)."""
    cache = {}

    def get(name: str, size: int | None):
        if (name, size) not in cache:
            cache[(name, size)] = build_plan(quantized(name), module_tmp / f"plan-{name}-tp{size}", limits=LIMITS,
                                             force=True, progress=False, tensor_parallel=size)
        return cache[(name, size)]

    return get


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path / "model.onnx").graph.initializer}


@pytest.mark.parametrize("name", ["fp8_w8a8_static", "fp8_w8a8_dynamic", "int4_asym_g32"])
def test_every_quantized_projection_is_sharded_and_one_rank_equals_the_unsharded_plan(name, plan):
    from trtopt.check.compare import Tolerance
    from trtopt.check.runner import Workload, compare_executors
    from trtopt.runtime.executors import create_executor

    result = plan(name, 1)
    layers = result.config.model.num_layers
    # Q/K/V and gate/up joined on the rank graph, after the sharding found them as separate projections
    assert result.report.counts["horizontal_matmul"] == 2 * layers
    layout = result.parallel
    assert len(layout.attention) == len(layout.mlp) == layers
    assert [r.why for r in layout.replicated] == [LM_HEAD_REPLICATED]  # the LM head (not quantized)
    rank0 = rank_dir(result.plan_dir, 0)
    proto = onnx.load(rank0 / "model.onnx", load_external_data=False)
    types = [n.op_type for n in proto.graph.node]
    assert types.count("QMatMul") == 4 * layers and types.count("AllReduce") == 2 * layers
    unsharded = plan(name, None).plan_dir
    single = read_plan(unsharded)
    executors = {"tp1": create_executor("onnxruntime", rank0, read_plan(rank0), num_blocks=24),
                 "whole": create_executor("onnxruntime", unsharded, single, num_blocks=24)}
    rng = np.random.default_rng(0)
    prompts = tuple(tuple(rng.integers(0, single.model.vocab_size, n).tolist()) for n in (21, 6, 1))
    results = compare_executors(single, executors, Workload(prompts, chunk=8, decode_steps=4),
                                Tolerance(atol=1e-4, rtol=0.0), reference="whole")
    assert results["tp1"].greedy_tokens == results["whole"].greedy_tokens
    assert results["tp1"].logits.max_abs <= 1e-4, results["tp1"].logits.max_abs


def joined_member(nodes: dict[str, onnx.NodeProto], name: str) -> tuple[onnx.NodeProto, slice]:
    """The horizontally joined QMatMul holding projection ``name``, and ``name``'s columns in it."""
    from trtopt.fusion_passes.horizontal_matmul import members

    for node in nodes.values():
        start = 0
        for member, width in members(node) or ():
            if member == name:
                return node, slice(start, start + width)
            start += width
    raise AssertionError(f"no joined QMatMul holds {name}")


@pytest.mark.parametrize("name", ["int4_asym_g32", "fp8_w8a8_static"])
def test_each_rank_holds_its_columns_and_rows_of_the_quantized_weights(name, plan):
    """q (columns: N), o (rows: K; INT4 scales and zero points by whole blocks, FP8 per-channel scales whole),
    against the plan sharded for one rank (whole weights, the same node names)."""
    one = rank_dir(plan(name, 1).plan_dir, 0)
    whole, whole_nodes = initializers(one), {n.name: n for n in onnx.load(one / "model.onnx").graph.node}
    result = plan(name, 2)
    attention = result.parallel.attention[0]
    o_name = f"{attention.o}.tp_row"
    group = 32 if name.startswith("int4") else 0
    for rank in range(2):
        got = initializers(rank_dir(result.plan_dir, rank))
        nodes = {n.name: n for n in onnx.load(rank_dir(result.plan_dir, rank) / "model.onnx").graph.node}
        q, o = joined_member(nodes, attention.q), nodes[o_name]
        whole_q = joined_member(whole_nodes, attention.q)
        part = slice(32 * rank, 32 * (rank + 1))  # q's columns and o's rows: 2 of the 4 query heads of 16
        for i in (1, 2, 3):
            np.testing.assert_array_equal(got[q[0].input[i]][..., q[1]],
                                          whole[whole_q[0].input[i]][..., whole_q[1]][..., part])
        np.testing.assert_array_equal(got[o.input[1]], whole[whole_nodes[o_name].input[1]][part])
        for i in (2, 3):
            want = whole[whole_nodes[o_name].input[i]]
            np.testing.assert_array_equal(got[o.input[i]], want[part.start // group:part.stop // group]
                                          if group else want)
        assert o.input[4] == whole_nodes[o_name].input[4]  # the activation scale: replicated


def test_a_row_shard_that_splits_an_int4_block_is_a_fusion_error_naming_the_group_sizes_that_work(plan):
    with pytest.raises(FusionError) as err:
        plan("int4_sym_g64", 2)
    message = str(err.value)
    assert "block_size 64" in message and "--group-size that divides 32 (e.g. 32)" in message
    assert "--tensor-parallel 1" in message


def test_a_horizontally_fused_qkv_qmatmul_is_refused_by_the_sharding(plan):
    """The sharding analysis finds Q/K/V as separate projections (a --tensor-parallel build joins them after it);
    a graph joined before sharding is refused."""
    fused = plan("int4_asym_g32", None)
    assert fused.report.counts["horizontal_matmul"] == 2 * fused.config.model.num_layers
    model = ir.load(str(fused.plan_dir / "model.onnx"))
    with pytest.raises(FusionError, match="Split lies on the path"):
        shard_structure(model, 2)


@pytest.mark.parametrize("name", ["fp8_w8a8_static", "int4_asym_g32", "fp8_w8a8_dynamic"])
def test_greedy_tokens_at_two_ranks_equal_one_rank(name, plan):
    """CPU, gloo. fp8_w8a8_dynamic: each rank's o/down per-token activation scale is the max over its own K shard,
    not over the whole row (as vLLM's row-parallel layers quantize), so its FP8 rounding differs from one rank's;
    this tiny random model's next-token margins are a few hundredths of a nat, within that noise, so there the
    first step's log-probabilities are compared instead of the tokens."""
    from trtopt.runtime.llm import LLM
    from trtopt.runtime.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with LLM(plan(name, None).plan_dir) as llm:
        want = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
    with LLM(plan(name, 2).plan_dir, tensor_parallel_size=2) as llm:
        got = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
    assert not dist.is_initialized()
    if name != "fp8_w8a8_dynamic":
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        return
    for g, w in zip(got, want):
        first = w.token_ids[0]
        assert first in g.logprobs[0] and abs(g.logprobs[0][first] - w.logprobs[0][first]) < 0.25
