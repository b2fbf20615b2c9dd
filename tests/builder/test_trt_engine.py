"""The TensorRT engine build's pure logic (no tensorrt here): the optimization profile and plugin discovery."""

from __future__ import annotations

import dataclasses

import onnx
import pytest
from onnx import TensorProto, helper

from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.builder.trt_engine import max_pool_blocks, profile_shapes, register_plugins
from trtopt.errors import ConfigError
from trtopt.signature import STEP_INPUT_NAMES

PLAN = PlanConfig(
    model=ModelFacts(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=1000, dtype="float16",
                     eos_token_ids=(2,)),
    limits=Limits(block_size=16, max_num_tokens=512, max_num_seqs=32, max_model_len=1000),
)


def test_profile_covers_every_input_of_the_paged_signature():
    shapes = profile_shapes(PLAN)
    assert set(shapes) == set(STEP_INPUT_NAMES) | {f"kv_cache.{i}" for i in range(3)}
    for name, shape in shapes.items():
        assert len(shape.min) == len(shape.opt) == len(shape.max), name
        assert all(lo <= opt <= hi for lo, opt, hi in zip(shape.min, shape.opt, shape.max)), name


def test_profile_bounds_come_from_limits():
    shapes = profile_shapes(PLAN)
    blocks_per_seq = 63  # ceil(1000 / 16)
    assert shapes["input_ids"].min == (1, 1) and shapes["input_ids"].max == (1, 512)
    assert shapes["slot_mapping"].max == (512,) and shapes["logits_indices"].max == (512,)
    assert shapes["block_tables"].max == (32, blocks_per_seq)
    assert shapes["seq_lens"].max == (32,)
    assert shapes["query_start_loc"].min == (2,) and shapes["query_start_loc"].max == (33,)
    assert max_pool_blocks(PLAN) == 32 * blocks_per_seq + 1
    assert shapes["kv_cache.2"].max == (32 * blocks_per_seq + 1, 2, 2, 16, 64)
    assert shapes["kv_cache.0"].min == (2, 2, 2, 16, 64)


def test_profile_opt_is_the_decode_regime_unless_told():
    shapes = profile_shapes(PLAN)
    assert shapes["input_ids"].opt == (1, 32) and shapes["seq_lens"].opt == (32,)
    prefill = profile_shapes(PLAN, opt_num_tokens=256, max_num_blocks=100)
    assert prefill["input_ids"].opt == (1, 256) and prefill["kv_cache.0"].max[0] == 100
    small = dataclasses.replace(PLAN, limits=Limits(block_size=16, max_num_tokens=8, max_num_seqs=32, max_model_len=64))
    assert profile_shapes(small)["input_ids"].opt == (1, 8) and profile_shapes(small)["seq_lens"].opt == (8,)
    with pytest.raises(ConfigError, match="max_num_blocks must be >= 2"):
        profile_shapes(PLAN, max_num_blocks=1)


def test_registers_only_ops_that_have_a_plugin(tmp_path) -> None:
    # MatMulAdd has no plugin (TensorRT inlines its body), so nothing is imported for it.
    node = helper.make_node("MatMulAdd", ["x", "w", "b"], ["y"], domain="trtopt")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                            for n in ("x", "w", "b")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("trtopt", 1)]),
              str(path))
    assert register_plugins(path) == []
    from trtopt.plugins.matmul_add import trt_plugin

    assert trt_plugin.HAS_TENSORRT_PLUGIN is False


def test_tensorrt_parses_a_copy_whose_paged_attention_nodes_carry_every_attribute(plan_dir) -> None:
    """A bf16-pool plan's PagedAttention nodes leave the FP8 attributes off; the plugin declares them and TensorRT
    has no defaults, so the model TensorRT parses is a copy with them written at the schema's defaults, sharing the
    plan's external data, and otherwise the same graph. A model whose nodes carry them all is parsed as it is."""
    from trtopt.builder.plan import MODEL_FILE
    from trtopt.builder.trt_engine import TRT_MODEL_FILE, trt_model_path
    from trtopt.plugins import paged_attention

    model_path = plan_dir("tiny-llama") / MODEL_FILE
    original = onnx.load(str(model_path), load_external_data=False)
    paged = [n for n in original.graph.node if n.op_type == "PagedAttention"]
    assert paged and all("k_scale" not in {a.name for a in n.attribute} for n in paged)

    copy_path = trt_model_path(model_path)
    assert copy_path == model_path.with_name(TRT_MODEL_FILE)
    copy = onnx.load(str(copy_path))  # its external data resolves beside it
    onnx.checker.check_model(copy)
    declared = [a.name for a in paged_attention.schema.SCHEMA.attributes]
    for node in (n for n in copy.graph.node if n.op_type == "PagedAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert set(declared) <= set(attrs)
        assert (attrs["kv_cache_dtype"], attrs["k_scale"], attrs["v_scale"]) == (b"auto", 1.0, 1.0)
    for node in copy.graph.node:  # nothing else changed
        node.ClearField("attribute")
    for node in original.graph.node:
        node.ClearField("attribute")
    assert [n.SerializeToString() for n in copy.graph.node] == [n.SerializeToString() for n in original.graph.node]
    assert trt_model_path(copy_path) == copy_path  # complete already: parsed as it is
