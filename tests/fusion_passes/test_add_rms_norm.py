from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, apply, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.add_rms_norm import fuse_add_rms_norm
from trtopt.fusion_passes.trace import Trace
from trtopt.plugins import make_node

RNG = np.random.default_rng(7)


def _block(*, bias: bool = False):
    """Two pre-norm residual steps: h1 = x + a; n1 = RMSNorm(h1); h2 = h1 + n1 @ W; n2 = RMSNorm(h2).
    h1 is read by the norm and by the next residual Add; with ``bias`` the first Add adds a constant instead."""
    nodes = [helper.make_node("Add", ["x", "bias" if bias else "a"], ["h1"]),
             make_node("RMSNorm", ["h1", "s1"], ["n1"], epsilon=1e-5),
             helper.make_node("MatMul", ["n1", "w"], ["m"]),
             helper.make_node("Add", ["h1", "m"], ["h2"]),
             make_node("RMSNorm", ["h2", "s2"], ["n2"], epsilon=1e-6)]
    inits = [("s1", RNG.random(8) + 0.5), ("s2", RNG.random(8) + 0.5), ("w", RNG.standard_normal((8, 8)))]
    if bias:
        inits.append(("bias", RNG.standard_normal(8)))
    inputs = [helper.make_tensor_value_info(n, FLOAT, ["T", 8]) for n in ("x", "a")]
    outputs = [helper.make_tensor_value_info(n, FLOAT, ["T", 8]) for n in ("n2", "h2")]
    proto = model(nodes, inputs, outputs, [(k, v.astype(np.float32)) for k, v in inits])
    proto.opset_import.append(helper.make_opsetid("trtopt", 1))
    return proto


def test_residual_add_and_norm_become_one_op_with_both_outputs():
    proto = _block()
    count, fused = apply(proto, fuse_add_rms_norm)
    assert count == 2
    types = op_types(fused)
    assert types.count("AddRMSNorm") == 2 and "Add" not in types and "RMSNorm" not in types
    assert [o.name for o in fused.graph.output] == ["n2", "h2"]  # the residual sum stays a graph output
    feeds = {n: RNG.standard_normal((5, 8)).astype(np.float32) for n in ("x", "a")}
    for got, want in zip(run(fused, feeds), run(proto, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_bias_add_is_not_a_residual_and_is_explained():
    m = ir.from_proto(_block(bias=True))
    trace = Trace()
    assert fuse_add_rms_norm(m, trace) == 1  # only the second norm reads a residual sum
    assert [f.rule for f in trace.failures] == ["add_rms_norm"] and "constant" in trace.failures[0].reason


@pytest.mark.parametrize("name,exporter", [("tiny-llama", "dynamo"), ("tiny-qwen2", "dynamo"), ("tiny-llama", "legacy")])
def test_fused_plan_has_two_add_rms_norms_per_layer(fused, name, exporter):
    """Each layer's post-attention norm and the next layer's (or the final) input norm; only layer 0's input norm,
    on the embedding, stays a plain RMSNorm. The plans run against the unfused export on ORT (≤ 1e-4) in
    test_paged_attention.py::test_paged_generation_matches_original, and bit for bit against the plan without this
    pass on the torch executor in tests/runtime/executors/test_plan_fusions.py."""
    f = fused(name, exporter)
    layers = f.config["num_hidden_layers"]
    types = [n.op_type for n in f.proto.graph.node]
    assert f.report.counts["add_rms_norm"] == 2 * layers and types.count("AddRMSNorm") == 2 * layers
    assert types.count("RMSNorm") == 1
    assert not [u for u in f.report.unfused if u.rule == "add_rms_norm"]


def _gemma_half_block(*, cast_read_elsewhere: bool = False):
    """Gemma's fp16 residual step after rms_norm.py: h = x + a (fp16), an fp32 RMSNorm with an fp32 scale on
    Cast(h), then the downcast; h stays an output (the next residual)."""
    from onnx import TensorProto

    half = TensorProto.FLOAT16
    nodes = [helper.make_node("Add", ["x", "a"], ["h"]), helper.make_node("Cast", ["h"], ["h32"], to=FLOAT),
             make_node("RMSNorm", ["h32", "s"], ["n32"], epsilon=1e-6),
             helper.make_node("Cast", ["n32"], ["n"], to=half)]
    outputs = [helper.make_tensor_value_info("n", half, ["T", 8]), helper.make_tensor_value_info("h", half, ["T", 8])]
    if cast_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("h32", FLOAT, ["T", 8]))
    proto = model(nodes, [helper.make_tensor_value_info(n, half, ["T", 8]) for n in ("x", "a")], outputs,
                  [("s", (RNG.random(8) + 1).astype(np.float32))])
    proto.opset_import.append(helper.make_opsetid("trtopt", 1))
    return proto


def test_gemma_half_precision_add_cast_and_fp32_norm_become_one_op():
    """The Cast between the fp16 sum and the fp32 norm is absorbed; with its fp32 scale the op does the norm in fp32
    (schema.py), so both outputs equal the unfused graph's on ORT bit for bit. A Cast read elsewhere is kept whole."""
    proto = _gemma_half_block()
    count, fused = apply(proto, fuse_add_rms_norm)
    assert count == 1 and [t for t in op_types(fused)] == ["AddRMSNorm", "Cast"]
    feeds = {n: (3 * RNG.standard_normal((5, 8))).astype(np.float16) for n in ("x", "a")}
    for got, want in zip(run(fused, feeds), run(proto, feeds)):
        assert got.dtype == want.dtype == np.float16
        np.testing.assert_array_equal(got, want)
    assert apply(_gemma_half_block(cast_read_elsewhere=True), fuse_add_rms_norm)[0] == 0
