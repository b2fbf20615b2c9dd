from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, apply, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.horizontal_matmul import fuse_horizontal_matmul
from trtopt.fusion_passes.trace import Trace

RNG = np.random.default_rng(3)


def _layer(*, bias: bool, k_dim: int = 8):
    """One attention input projection (q 8 wide, k and v 4 wide, optional biases) and a SwiGLU gate/up pair."""
    inits = [("wq", RNG.standard_normal((8, 8))), ("wk", RNG.standard_normal((k_dim, 4))),
             ("wv", RNG.standard_normal((8, 4))), ("wg", RNG.standard_normal((8, 6))), ("wu", RNG.standard_normal((8, 6)))]
    nodes = []
    for p in "qkv":
        nodes.append(helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}0" if bias else p]))
        if bias:
            inits.append((f"b{p}", RNG.standard_normal(8 if p == "q" else 4)))
            nodes.append(helper.make_node("Add", [f"b{p}" if p == "k" else f"{p}0", f"{p}0" if p == "k" else f"b{p}"], [p]))
    nodes += [helper.make_node("MatMul", ["h", "wg"], ["g"]), helper.make_node("MatMul", ["h", "wu"], ["u"]),
              helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
              helper.make_node("Mul", ["silu", "u"], ["mlp"])]
    outputs = [helper.make_tensor_value_info(n, FLOAT, ["T", w]) for n, w in (("q", 8), ("k", 4), ("v", 4), ("mlp", 6))]
    inputs = [helper.make_tensor_value_info(n, FLOAT, ["T", 8]) for n in ("x", "h")]  # the two norms' outputs
    return model(nodes, inputs, outputs,
                 [(k, v.astype(np.float32)) for k, v in inits])


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-biases"])
def test_qkv_and_gate_up_become_one_matmul_each(bias):
    proto = _layer(bias=bias)
    count, fused = apply(proto, fuse_horizontal_matmul)
    assert count == 2  # q/k/v and gate/up
    types = op_types(fused)
    assert types.count("MatMul") == 2 and types.count("Split") == 2 and types.count("Add") == (1 if bias else 0)
    assert len(fused.graph.initializer) == 2 + 2 + (1 if bias else 0)  # the old weights are gone
    feeds = {n: RNG.standard_normal((5, 8)).astype(np.float32) for n in ("x", "h")}
    for got, want in zip(run(fused, feeds), run(proto, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_weights_of_another_k_are_not_grouped_and_explained():
    proto = _layer(bias=False)
    proto.graph.node[1].input[0] = "x2"  # k reads another input of width 8: q and v still group
    proto.graph.input.append(helper.make_tensor_value_info("x2", FLOAT, ["T", 8]))
    count, fused = apply(proto, fuse_horizontal_matmul)
    assert count == 2 and op_types(fused).count("MatMul") == 3
    m = ir.from_proto(_layer(bias=False, k_dim=8))
    m.graph.initializers["wk"].const_value = ir.tensor(RNG.standard_normal((8, 4)).astype(np.float16), name="wk")
    trace = Trace()
    assert fuse_horizontal_matmul(m, trace) == 1  # gate/up only: q/k/v mix fp32 and fp16 weights
    assert [f.rule for f in trace.failures] == ["horizontal_matmul"] and "dtype" in trace.failures[0].reason


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fused_plan_has_one_qkv_and_one_gate_up_matmul_per_layer(fused, name):
    """The pipeline on real exports (Qwen2 has q/k/v biases): 4 projections a layer (qkv, o, gate/up, down), and
    the fusion report counts 2 groups a layer. (The paged tests run these plans against the unfused export on ORT.)"""
    f = fused(name)
    layers = f.config["num_hidden_layers"]
    types = [n.op_type for n in f.proto.graph.node]
    assert f.report.counts["horizontal_matmul"] == 2 * layers
    assert types.count("Split") == 2 * layers
    assert types.count("MatMul") + types.count("MatMulAdd") == 4 * layers + 1, types  # + lm_head
