"""The sharding analysis on tiny hand-written graphs: an MLP it splits, the checks that fail recorded as values with
their reasons (STYLE.md 7), and the layout's report and --explain lines. The rank plans of real exports are tested in
tests/runtime/executors/test_tensor_parallel_plans.py."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtopt import signature
from trtopt.builder.pipeline import fit_limits
from trtopt.builder.plan import Limits
from trtopt.builder.sharding import (
    AttentionShard,
    LmHeadSplit,
    MlpShard,
    ParallelLayout,
    ReplicatedProjection,
    lm_head_reason,
    shard_structure,
    unsharded_reasons,
)
from trtopt.builder.sharding.analysis import LM_HEAD_REPLICATED, _analyze
from trtopt.errors import ConfigError, FusionError
from trtopt.fusion_passes.ops import DOMAIN
from trtopt.fusion_passes.trace import MatchFailure


def _mlp_model(intermediate: int) -> ir.Model:
    """input_ids -> Gather(embedding [16, 8]) -> up [8, I] -> Relu -> down [I, 8]: one MLP, no attention."""
    ids = signature.INPUT_IDS.name
    nodes = [
        helper.make_node("Gather", ["emb", ids], ["h"], name="embed"),
        helper.make_node("MatMul", ["h", "w_up"], ["u"], name="up"),
        helper.make_node("Relu", ["u"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "w_down"], ["y"], name="down"),
    ]
    rng = np.random.default_rng(0)
    weights = {"emb": (16, 8), "w_up": (8, intermediate), "w_down": (intermediate, 8)}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(ids, TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 8])],
        [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in weights.items()],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_an_mlp_is_split_by_its_intermediate_width():
    found = _analyze(_mlp_model(6), 2, "replicated")
    assert found.mlp == [MlpShard(up=("up",), down="down")]
    assert [n.name for n in found.column] == ["up"] and [n.name for n in found.row] == ["down"]
    assert found.column[next(iter(found.column))] == (((0, 3),), ((3, 6),))
    assert found.replicated == [] and found.failures == []


def test_an_mlp_that_cannot_split_stays_whole_with_the_failed_check_as_its_reason():
    found = _analyze(_mlp_model(6), 4, "replicated")
    assert found.mlp == []
    assert found.replicated == [
        ReplicatedProjection("up", "Gather lies on the path", "embed"),
        ReplicatedProjection("down", "intermediate size 6 is not a multiple of --tensor-parallel 4"),
    ]


def _layout(**changes) -> ParallelLayout:
    base = dict(size=2, num_heads=4, num_kv_heads=2, heads_per_rank=2, kv_heads_per_rank=1,
                kv_heads_replicated=False, attention=(AttentionShard("attn0", "q0", "k0", "v0", "o0"),),
                mlp=(MlpShard(("gate0", "up0"), "down0"),),
                replicated=(ReplicatedProjection("head", LM_HEAD_REPLICATED, "gather"),))
    return ParallelLayout(**{**base, **changes})


def test_the_layout_report_keeps_its_json_shape():
    report = json.loads(json.dumps(_layout().to_dict()))
    assert report["attention"] == [{"attention": "attn0", "q": "q0", "k": "k0", "v": "v0", "o": "o0"}]
    assert report["mlp"] == [{"up": ["gate0", "up0"], "down": "down0"}]
    assert report["replicated"] == [{"node": "head", "why": "LM head: replicated (the driver samples full-vocabulary "
                                     "rows)", "at": "gather"}]
    assert report["lm_head_split"] is None and report["all_reduces_per_step"] == 2
    assert unsharded_reasons(_layout()) == [
        "tensor_parallel | head: not sharded: LM head: replicated (the driver samples full-vocabulary rows) (at gather)"
    ]
    assert lm_head_reason(_layout()) is None


def test_a_vocab_parallel_head_is_explained():
    split = LmHeadSplit(node="head", weight="w", tied=False, hidden=64, vocab=49152, vocab_per_rank=24576, padding=0,
                        dtype_bytes=4, weight_bytes_saved_per_rank=64 * 24576 * 4)
    layout = _layout(lm_head="vocab-parallel", lm_head_split=split, replicated=())
    assert layout.to_dict()["lm_head_split"]["vocab_per_rank"] == 24576 and layout.num_all_gathers == 1
    assert lm_head_reason(layout) == (
        "tensor_parallel | head: LM head vocab-parallel: 24576 of 49152 vocabulary columns per rank; one all-gather of "
        "the sampled logits rows per step; saves 6.0 MiB of head weights per rank (hidden 64 x vocab x 4 B x (N-1)/N)")


def _attention_model() -> ir.Model:
    """A trtopt.PagedAttention (4 query / 2 KV heads of 2) reading the graph input directly: no projections."""
    x = ir.Value(name=signature.INPUT_IDS.name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 8]))
    attrs = [ir.AttrInt64("num_heads", 4), ir.AttrInt64("num_kv_heads", 2), ir.AttrInt64("head_dim", 2)]
    node = ir.Node(DOMAIN, "PagedAttention", [x, x, x], attrs, name="attn")
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18, DOMAIN: 1})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("size,reason", [
    (3, "num_heads 4 is not a multiple of --tensor-parallel 3"),
    (2, f"{signature.INPUT_IDS.name} is a graph input, not a projection's output"),
])
def test_attention_that_cannot_split_is_a_match_failure_value(size, reason):
    found = _analyze(_attention_model(), size, "replicated")
    assert found.failures == [MatchFailure("tensor_parallel", "attn", reason)] and found.attention == []


def test_attention_that_cannot_split_is_a_fusion_error_naming_the_layer():
    message = r"1 attention layer\(s\) cannot be sharded over 3 ranks:\n  attn: num_heads 4"
    with pytest.raises(FusionError, match=message):
        shard_structure(_attention_model(), 3)


@pytest.mark.parametrize("limits,max_model_len,context,expected", [
    (None, None, 512, 512),  # the default 2048 capped at the model's context
    (None, None, 0, 2048),  # unknown context: the default
    (None, 300, 512, 300),  # explicit, within the context
    (Limits(max_model_len=4096), None, 1024, 1024),  # given limits are capped too
    (Limits(max_model_len=256), None, 1024, 256),
    (None, 10**6, 0, 10**6),  # unknown context: explicit values are taken as they are
])
def test_the_context_length_rule(limits, max_model_len, context, expected):
    assert fit_limits(limits, max_model_len, context).max_model_len == expected


def test_an_explicit_max_model_len_beyond_the_context_is_refused():
    with pytest.raises(ConfigError, match="--max-model-len 600 exceeds the model's max_position_embeddings 512"):
        fit_limits(None, 600, 512)


def test_projections_joined_after_sharding_give_each_rank_its_own_slices_side_by_side():
    """h -> gate, up (an MLP split by I) and side (a projection no rule splits): joined on the rank graph into
    [gate_r | up_r | side] for rank r, side cut out of rank 0's join whole; the Split widths agree on every rank."""
    from trtopt.builder.sharding import join_fused, rank_weights
    from trtopt.fusion_passes.horizontal_matmul import fuse_horizontal_matmul

    ids = signature.INPUT_IDS.name
    nodes = [
        helper.make_node("Gather", ["emb", ids], ["h"], name="embed"),
        helper.make_node("MatMul", ["h", "w_gate"], ["g"], name="gate"),
        helper.make_node("MatMul", ["h", "w_up"], ["u"], name="up"),
        helper.make_node("MatMul", ["h", "w_side"], ["side"], name="side"),
        helper.make_node("Relu", ["g"], ["a"], name="act"),
        helper.make_node("Mul", ["a", "u"], ["m"], name="mul"),
        helper.make_node("MatMul", ["m", "w_down"], ["y"], name="down"),
    ]
    rng = np.random.default_rng(0)
    shapes = {"emb": (16, 8), "w_gate": (8, 12), "w_up": (8, 12), "w_side": (8, 3), "w_down": (12, 8)}
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(ids, TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, "T", 8 if o == "y" else 3]) for o in ("y", "side")],
        [numpy_helper.from_array(w, n) for n, w in weights.items()],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    found = _analyze(model, 2, "replicated")
    assert len(found.mlp) == 1
    result = _shard_mlp_only(model, 2)
    sources: dict = {}
    assert fuse_horizontal_matmul(model, sources=sources) == 1
    result = join_fused(result, model, sources)
    (name, join), = result.joins.items()
    assert join.shape == (8, 6 + 6 + 3) and list(join.shared) == [join.members[2]]
    np.testing.assert_array_equal(model.graph.initializers[name].const_value.numpy(),
                                  np.concatenate([weights["w_gate"][:, :6], weights["w_up"][:, :6],
                                                  weights["w_side"]], axis=1))
    got = rank_weights(result, 1)
    assert not set(got) & set(join.members[:2])  # the split gate/up slices live only inside the join now
    np.testing.assert_array_equal(got[name], np.concatenate([weights["w_gate"][:, 6:], weights["w_up"][:, 6:],
                                                             weights["w_side"]], axis=1))


def _shard_mlp_only(model: ir.Model, size: int):
    """shard_structure's column/row rewrite of the MLPs of a graph without attention (which it refuses)."""
    from trtopt.builder.sharding.analysis import ShardResult, _Rewriter

    found = _analyze(model, size, "replicated")
    rewriter = _Rewriter(model, size)
    for node, ranges in found.column.items():
        rewriter.column(node, ranges)
    for node, ranges in found.row.items():
        rewriter.row(node, ranges)
    for name in [n for n, v in model.graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del model.graph.initializers[name]
    layout = ParallelLayout(size=size, num_heads=0, num_kv_heads=0, heads_per_rank=0, kv_heads_per_rank=0,
                            kv_heads_replicated=False, attention=(), mlp=tuple(found.mlp), replicated=())
    return ShardResult(layout, tuple(rewriter.splits.values()), rewriter.full)
