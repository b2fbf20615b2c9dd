from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, apply, model, op_types, run
from onnx import helper, numpy_helper

from trtopt.fusion_passes.rope import fuse_rope
from trtopt.fusion_passes.trace import Trace

RNG = np.random.default_rng(11)
END = 2**63 - 1


def _rope_graph(*, swap: bool = False, hi_end: int = END, half_from_shape: bool = False, qk_norm: bool = False):
    """HF's apply_rotary_pos_emb on q [1, H, T, 8] (a Transpose output, as the exporters hand it over):
    q·cos + cat(−q[..., 4:], q[..., :4])·sin; ``swap`` flips every commutative operand order; ``qk_norm`` puts
    Gemma-3's q RMSNorm, q·(1 + w)/sqrt(mean(q²) + eps), between the Transpose and the rotation."""
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [c("zero", [0]), c("four", [4]), c("end", [hi_end]), c("ax", [3]), c("one", [1])]
    nodes = [helper.make_node("Transpose", ["q_bthd"], ["q" if not qk_norm else "q_raw"], perm=[0, 2, 1, 3])]
    if qk_norm:
        f = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
        inits += [f("two_f", 2.0), f("eps", 1e-6), f("w1", RNG.standard_normal(8) * 0.1 + 1.0), c("last", [-1])]
        nodes += [helper.make_node("Pow", ["q_raw", "two_f"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
                  helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
                  helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["q_raw", "inv"], ["qn"]),
                  helper.make_node("Mul", ["qn", "w1"], ["q"])]
    half = "four"
    if half_from_shape:  # TorchScript: half = Unsqueeze(Div(Gather(Shape(q), 3), 2), [0])
        inits += [numpy_helper.from_array(np.array(3, np.int64), "i3"), numpy_helper.from_array(np.array(2, np.int64), "two"),
                  c("zero_ax", [0])]
        nodes += [helper.make_node("Shape", ["q"], ["qs"]), helper.make_node("Gather", ["qs", "i3"], ["d"], axis=0),
                  helper.make_node("Div", ["d", "two"], ["h0"]), helper.make_node("Unsqueeze", ["h0", "zero_ax"], ["h"])]
        half = "h"
    nodes += [helper.make_node("Slice", ["q", "zero", half, "ax", "one"], ["lo"]),
              helper.make_node("Slice", ["q", half, "end", "ax", "one"], ["hi"]),
              helper.make_node("Neg", ["hi"], ["nhi"]), helper.make_node("Concat", ["nhi", "lo"], ["rot"], axis=-1),
              helper.make_node("Mul", ["cos", "q"] if swap else ["q", "cos"], ["a"]),
              helper.make_node("Mul", ["sin", "rot"] if swap else ["rot", "sin"], ["b"]),
              helper.make_node("Add", ["b", "a"] if swap else ["a", "b"], ["y"])]
    inputs = [helper.make_tensor_value_info("q_bthd", FLOAT, [1, "T", 3, 8]),
              helper.make_tensor_value_info("cos", FLOAT, [1, 1, "T", 8]), helper.make_tensor_value_info("sin", FLOAT, [1, 1, "T", 8])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", FLOAT, [1, 3, "T", 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(t: int = 5):
    angles = RNG.random((t, 4)) * 20
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[None, None].astype(np.float32) for f in (np.cos, np.sin))
    return {"q_bthd": RNG.standard_normal((1, t, 3, 8)).astype(np.float32), "cos": cos, "sin": sin}


@pytest.mark.parametrize("swap,half_from_shape", [(False, False), (True, False), (False, True)],
                         ids=["dynamo", "operands-swapped", "torchscript-half"])
def test_rope_becomes_one_op_and_runs_the_same(swap, half_from_shape):
    proto = _rope_graph(swap=swap, half_from_shape=half_from_shape)
    count, fused = apply(proto, fuse_rope)
    assert count == 1
    types = op_types(fused)
    assert types == ["Transpose", "Rope"], types  # every matched node, the Shape arithmetic included, is gone
    assert [a.i for n in fused.graph.node if n.op_type == "Rope" for a in n.attribute if a.name == "half"] == \
        [0 if half_from_shape else 4]
    feeds = _feeds()
    np.testing.assert_array_equal(run(fused, feeds)[0], run(proto, feeds)[0])  # the same ops: bit for bit on ORT


def test_rotation_of_a_normed_q_with_a_positive_slice_axis_is_fused():
    """Gemma-3 rotates its q/k RMSNorm's output and both exporters slice along axis 3 (not -1): x's rank comes from
    the Transpose before the norm (no value carries a shape after the paged rewrite). It used to be a near-miss,
    "the slices (axes 3, 3) and the Concat (axis -1) are not all along x's last axis"."""
    proto = _rope_graph(qk_norm=True)
    m = ir.from_proto(proto)
    for node in m.graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None  # as after the paged rewrite
    trace = Trace()
    assert fuse_rope(m, trace) == 1 and not trace.failures
    fused = ir.to_proto(m)
    assert "Rope" in op_types(fused) and "Neg" not in op_types(fused)
    feeds = _feeds()
    np.testing.assert_array_equal(run(fused, feeds)[0], run(proto, feeds)[0])


def test_a_slice_short_of_the_end_is_left_and_explained():
    m = ir.from_proto(_rope_graph(hi_end=7))
    trace = Trace()
    assert fuse_rope(m, trace) == 0
    assert [f.rule for f in trace.failures] == ["rope"] and "end of the axis" in trace.failures[0].reason


@pytest.mark.parametrize("name,exporter", [("tiny-llama", "dynamo"), ("tiny-qwen2", "dynamo"), ("tiny-llama", "legacy")])
def test_fused_plan_has_a_rope_for_q_and_k_per_layer(fused, name, exporter):
    """Every rotary subgraph the torch executor's fx rewrite used to find is now in the plan (q and k of each layer,
    half constant in dynamo exports, from Shape in TorchScript ones). The plans run against the unfused export on
    ORT (≤ 1e-4) in test_paged_attention.py::test_paged_generation_matches_original, and bit for bit against the
    plan without this pass on the torch executor in tests/runtime/executors/test_plan_fusions.py."""
    f = fused(name, exporter)
    layers = f.config["num_hidden_layers"]
    types = [n.op_type for n in f.proto.graph.node]
    assert f.report.counts["rope"] == 2 * layers and types.count("Rope") == 2 * layers
    assert "Neg" not in types
    assert not [u for u in f.report.unfused if u.rule == "rope"]


def test_gpt2_has_no_rope(fused):
    assert fused("tiny-gpt2").report.counts["rope"] == 0
