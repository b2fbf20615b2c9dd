"""The GELU·mul (GeGLU) rule: every form the exporters write, near misses, and real tiny Gemma-3 exports."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, apply, const, model, op_types, run
from onnx import helper

from trtopt.fusion_passes.gelu_mul import fuse_gelu_mul
from trtopt.fusion_passes.trace import Trace

RNG = np.random.default_rng(7)
C = math.sqrt(2 / math.pi)

# Each form as the exporter writes it: GELU(g) → "act". (dynamo: initializers and Pow; legacy: Constant nodes and
# g·(g·g); legacy at opset ≥ 20: the standard Gelu.)
FORMS = {
    "dynamo-tanh": ([helper.make_node("Pow", ["g", "three"], ["cube"]), helper.make_node("Mul", ["kappa", "cube"], ["kc"]),
                     helper.make_node("Add", ["g", "kc"], ["s"]), helper.make_node("Mul", ["beta", "s"], ["z"]),
                     helper.make_node("Tanh", ["z"], ["t"]), helper.make_node("Add", ["t", "one"], ["p"]),
                     helper.make_node("Mul", ["half", "p"], ["hp"]), helper.make_node("Mul", ["g", "hp"], ["act"])], 1),
    "legacy-tanh": ([const("c_kappa", np.float32(0.044715)), const("c_beta", np.float32(C)),
                     const("c_one", np.float32(1.0)), const("c_half", np.float32(0.5)),
                     helper.make_node("Mul", ["g", "g"], ["sq"]), helper.make_node("Mul", ["g", "sq"], ["cube"]),
                     helper.make_node("Mul", ["c_kappa", "cube"], ["kc"]), helper.make_node("Add", ["g", "kc"], ["s"]),
                     helper.make_node("Mul", ["c_beta", "s"], ["z"]), helper.make_node("Tanh", ["z"], ["t"]),
                     helper.make_node("Add", ["c_one", "t"], ["p"]), helper.make_node("Mul", ["g", "p"], ["gp"]),
                     helper.make_node("Mul", ["c_half", "gp"], ["act"])], 1),
    "gpt2-style-tanh": ([helper.make_node("Mul", ["half", "g"], ["hg"]), helper.make_node("Pow", ["g", "three"], ["cube"]),
                         helper.make_node("Mul", ["cube", "kappa"], ["kc"]), helper.make_node("Add", ["kc", "g"], ["s"]),
                         helper.make_node("Mul", ["s", "beta"], ["z"]), helper.make_node("Tanh", ["z"], ["t"]),
                         helper.make_node("Add", ["one", "t"], ["p"]), helper.make_node("Mul", ["hg", "p"], ["act"])], 1),
    "dynamo-erf": ([helper.make_node("Div", ["g", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                    helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["half", "p"], ["hp"]),
                    helper.make_node("Mul", ["g", "hp"], ["act"])], 0),
    "erf-times-inverse": ([helper.make_node("Mul", ["g", "inv_sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                    helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["g", "p"], ["gp"]),
                    helper.make_node("Mul", ["gp", "half"], ["act"])], 0),
    "gelu-op-tanh": ([helper.make_node("Gelu", ["g"], ["act"], approximate="tanh")], 1),
    "gelu-op-exact": ([helper.make_node("Gelu", ["g"], ["act"])], 0),
}
SCALARS = {"three": 3.0, "kappa": 0.044715, "beta": C, "one": 1.0, "half": 0.5, "sqrt2": math.sqrt(2),
           "inv_sqrt2": 1 / math.sqrt(2)}


def _mlp(form: str, *, swap: bool = False, split: bool = False, up_shape=("T", 6), extra_reader: bool = False,
         kappa: float = 0.044715):
    """HF's down(gelu(gate(h)) * up(h)); ``split``: gate and up are the halves of one MatMul (the horizontal fusion's
    output); ``swap`` flips the gating Mul's operands."""
    gelu_nodes, _ = FORMS[form]
    if split:
        proj = [helper.make_node("MatMul", ["h", "wgu"], ["gu"]),
                helper.make_node("Split", ["gu", "sizes"], ["g", "u"], axis=-1)]
    else:
        proj = [helper.make_node("MatMul", ["h", "wg"], ["g"]), helper.make_node("MatMul", ["h", "wu"], ["u0"]),
                helper.make_node("Identity", ["u0"], ["u"])]
    nodes = [*proj, *gelu_nodes, helper.make_node("Mul", ["u", "act"] if swap else ["act", "u"], ["y0"]),
             helper.make_node("MatMul", ["y0", "wd"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", FLOAT, ["T", 8])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("act", FLOAT, ["T", 6]))
    wg, wu = RNG.standard_normal((8, 6)), RNG.standard_normal((8, 6))
    inits = [("wd", RNG.standard_normal((6, 8)).astype(np.float32))]
    inits += [("wgu", np.concatenate([wg, wu], 1).astype(np.float32)), ("sizes", np.array([6, 6], np.int64))] if split \
        else [("wg", wg.astype(np.float32)), ("wu", wu.astype(np.float32))]
    used = {i for n in gelu_nodes for i in n.input}
    inits += [(k, np.float32(kappa if k == "kappa" else v)) for k, v in SCALARS.items() if k in used]
    opset = 20 if form.startswith("gelu-op") else 18
    proto = model(nodes, [helper.make_tensor_value_info("h", FLOAT, ["T", 8])], outputs, inits, opset=opset)
    # Split: dtypes but no shapes, as the horizontal fusion leaves them after the paged rewrite cleared the shapes.
    proto.graph.value_info.extend([helper.make_tensor_value_info("g", FLOAT, None if split else ["T", 6]),
                                   helper.make_tensor_value_info("u", FLOAT, None if split else list(up_shape))])
    return proto


@pytest.mark.parametrize("split", [False, True], ids=["two-matmuls", "split"])
@pytest.mark.parametrize("form", list(FORMS))
def test_geglu_becomes_one_op_and_runs_the_same(form, split):
    proto = _mlp(form, swap=split, split=split)
    count, fused = apply(proto, fuse_gelu_mul)
    assert count == 1
    types = op_types(fused)
    assert types.count("GeluMul") == 1
    assert not {"Tanh", "Erf", "Gelu", "Pow", "Mul", "Add", "Div"} & set(types), types
    (node,) = [n for n in fused.graph.node if n.op_type == "GeluMul"]
    assert [a.i for a in node.attribute if a.name == "tanh"] == [FORMS[form][1]]
    feeds = {"h": RNG.standard_normal((5, 8)).astype(np.float32) * 2}
    np.testing.assert_allclose(run(fused, feeds)[0], run(proto, feeds)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case,reason", [("extra_reader", "readers"), ("broadcast", "one shape")])
def test_what_is_not_geglu_is_left_and_explained(case, reason):
    proto = _mlp("dynamo-tanh", extra_reader=case == "extra_reader",
                 up_shape=("T", 1) if case == "broadcast" else ("T", 6))
    m = ir.from_proto(proto)
    trace = Trace()
    assert fuse_gelu_mul(m, trace) == 0
    assert [f.rule for f in trace.failures] == ["gelu_mul"] and reason in trace.failures[0].reason
    assert "Tanh" in [n.op_type for n in m.graph]


def test_other_constants_are_not_a_gelu():
    """0.05 for 0.044715 is another function: left alone, and not reported as a GeGLU that failed."""
    m = ir.from_proto(_mlp("dynamo-tanh", kappa=0.05))
    trace = Trace()
    assert fuse_gelu_mul(m, trace) == 0 and not trace.failures


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_tiny_gemma3_has_one_gelu_mul_per_layer_and_runs_the_same_on_ort(fused, tiny_hf_dir, exporter):
    """On real Gemma-3 exports (gelu_pytorch_tanh; after the horizontal gate/up fusion, so gate and up are the two
    halves of one Split): one GeluMul(tanh=1) a layer and no Tanh left; the paged plan on ORT equals the unfused
    export with past KV within 1e-4 over a chunked prefill and decode steps. Greedy equality with HF on the torch
    executor is tests/export/test_architectures.py (gemma3) and, for a TorchScript export, the optimum fixture's."""
    from paged_harness import compare_generation, session

    f = fused(str(tiny_hf_dir("gemma3")), exporter)
    layers = f.config["num_hidden_layers"]
    nodes = [n for n in f.proto.graph.node if n.op_type == "GeluMul"]
    assert f.report.counts["gelu_mul"] == layers == len(nodes) == 3
    assert all(helper.get_attribute_value(n.attribute[0]) == 1 for n in nodes)
    assert f.report.counts["horizontal_matmul"] == 2 * layers  # q/k/v and gate/up: GeluMul reads the Split halves
    assert all(_producer_op(f.proto, n.input[0]) == _producer_op(f.proto, n.input[1]) == "Split" for n in nodes)
    assert "Tanh" not in [n.op_type for n in f.proto.graph.node]
    assert not [u for u in f.report.unfused if u.rule == "gelu_mul"]
    err = compare_generation(session(f.proto.SerializeToString()), session(str(f.source / "model.onnx")),
                             num_layers=layers, num_kv_heads=f.config["num_key_value_heads"],
                             head_dim=f.config["head_dim"], block_size=4, prompts=[[5, 17, 33, 2, 90, 11, 7, 41, 3],
                                                                                   [3, 4, 99]], decode_steps=3, chunk=4)
    assert err <= 1e-4


def _producer_op(proto, name: str) -> str | None:
    return next((n.op_type for n in proto.graph.node if name in n.output), None)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_gpt2_gelu_is_not_gated_and_not_reported(fused, exporter):
    """GPT-2's MLP GELU (gelu_new, the tanh form) feeds a MatMul (legacy: and a Shape): nothing to fuse, nothing to
    explain."""
    result = fused("tiny-gpt2", exporter)
    assert result.report.counts["gelu_mul"] == 0
    assert "Tanh" in op_types(result.proto)
    assert not [u for u in result.report.unfused if u.rule == "gelu_mul"]
