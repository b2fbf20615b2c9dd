from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, apply, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.silu_mul import fuse_silu_mul
from trtopt.fusion_passes.trace import Trace

RNG = np.random.default_rng(5)


def _mlp(*, swap: bool, up_shape=("T", 6), extra_reader: bool = False):
    """HF's down(silu(gate(h)) * up(h)); ``swap`` flips the operand order of both Muls (exporters differ)."""
    silu_in = ["sg", "g"] if swap else ["g", "sg"]
    nodes = [helper.make_node("MatMul", ["h", "wg"], ["g"]), helper.make_node("MatMul", ["h", "wu"], ["u0"]),
             helper.make_node("Identity", ["u0"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", silu_in, ["silu"]),
             helper.make_node("Mul", ["u", "silu"] if swap else ["silu", "u"], ["act"]),
             helper.make_node("MatMul", ["act", "wd"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", FLOAT, ["T", 8])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("silu", FLOAT, ["T", 6]))
    inits = [("wg", RNG.standard_normal((8, 6))), ("wu", RNG.standard_normal((8, 6))), ("wd", RNG.standard_normal((6, 8)))]
    proto = model(nodes, [helper.make_tensor_value_info("h", FLOAT, ["T", 8])], outputs,
                  [(k, v.astype(np.float32)) for k, v in inits])
    proto.graph.value_info.extend([helper.make_tensor_value_info("g", FLOAT, ["T", 6]),
                                   helper.make_tensor_value_info("u", FLOAT, list(up_shape))])
    return proto


@pytest.mark.parametrize("swap", [False, True], ids=["g*sigmoid(g)*u", "u*(sigmoid(g)*g)"])
def test_swiglu_becomes_one_op_and_runs_the_same(swap):
    proto = _mlp(swap=swap)
    count, fused = apply(proto, fuse_silu_mul)
    assert count == 1
    types = op_types(fused)
    assert "SiluMul" in types and "Sigmoid" not in types and "Mul" not in types
    feeds = {"h": RNG.standard_normal((5, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(fused, feeds)[0], run(proto, feeds)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case,reason", [("extra_reader", "readers"), ("broadcast", "one shape")])
def test_what_is_not_swiglu_is_left_and_explained(case, reason):
    proto = _mlp(swap=False, extra_reader=case == "extra_reader", up_shape=("T", 1) if case == "broadcast" else ("T", 6))
    m = ir.from_proto(proto)
    trace = Trace()
    assert fuse_silu_mul(m, trace) == 0
    assert [f.rule for f in trace.failures] == ["silu_mul"] and reason in trace.failures[0].reason
    assert "Sigmoid" in [n.op_type for n in m.graph]


@pytest.mark.parametrize("name,exporter", [("tiny-llama", "dynamo"), ("tiny-qwen2", "dynamo"), ("tiny-llama", "legacy")])
def test_fused_plan_has_one_silu_mul_per_layer(fused, name, exporter):
    """On real exports (after the horizontal gate/up fusion, so gate and up are the two halves of one Split): one
    SiluMul a layer and no Sigmoid left. The same plans are run against the unfused export on ORT (≤ 1e-4) by
    test_paged_attention.py::test_paged_generation_matches_original, and bit for bit against the plan without
    this pass on the torch executor by tests/runtime/executors/test_plan_fusions.py."""
    f = fused(name, exporter)
    layers = f.config["num_hidden_layers"]
    types = [n.op_type for n in f.proto.graph.node]
    assert f.report.counts["silu_mul"] == layers and types.count("SiluMul") == layers
    assert "Sigmoid" not in types
    assert not [u for u in f.report.unfused if u.rule == "silu_mul"]


def test_gpt2_has_no_silu_to_fuse(fused):
    assert fused("tiny-gpt2").report.counts["silu_mul"] == 0
