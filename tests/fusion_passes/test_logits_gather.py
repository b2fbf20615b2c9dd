from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, model, run
from onnx import TensorProto, helper

from trtopt.errors import FusionError
from trtopt.fusion_passes.logits_gather import gather_logits

RNG = np.random.default_rng(4)
EMB = RNG.standard_normal((10, 8)).astype(np.float32)
HEAD = RNG.standard_normal((8, 10)).astype(np.float32)


def _lm(head_op: str = "MatMul", tail: tuple[str, ...] = (), qdq: bool = False):
    """emb → Relu → LM head, then the row-wise ops in ``tail``: "scale" (Granite's Div by logits_scaling),
    "softcap" (Div, Tanh, Mul: Gemma-2's final soft-capping), "mix" (an Add of a full [vocab] vector: not row-wise
    by a scalar, so the head is not found through it)."""
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]), helper.make_node("Relu", ["h"], ["hr"])]
    if qdq:  # a static per-tensor FP8 activation Q/DQ in front of the head (ModelOpt's quantized LM head)
        nodes += [helper.make_node("QuantizeLinear", ["hr", "a_s", "a_zp"], ["hq"]),
                  helper.make_node("DequantizeLinear", ["hq", "a_s", "a_zp"], ["hdq"])]
        nodes[1].output[0] = "hr"
    if head_op == "MatMul":
        nodes.append(helper.make_node("MatMul", ["hdq" if qdq else "hr", "head"], ["l0"]))
    else:
        nodes.append(helper.make_node("Einsum", ["hr", "head"], ["l0"], equation="btd,dv->btv"))
    inits = [("emb", EMB), ("head", HEAD), ("four", np.array(4.0, np.float32)), ("cap", np.array([3.0], np.float32)),
             ("bias", RNG.standard_normal(10).astype(np.float32)), ("a_s", np.array(0.01, np.float32)),
             ("a_zp", np.zeros((), ml_dtypes.float8_e4m3fn))]
    last = "l0"
    for i, op in enumerate(tail):
        out = f"l{i + 1}"
        if op == "scale":
            nodes.append(helper.make_node("Div", [last, "four"], [out]))
        elif op == "softcap":
            nodes += [helper.make_node("Div", [last, "cap"], [f"{out}a"]),
                      helper.make_node("Tanh", [f"{out}a"], [f"{out}b"]),
                      helper.make_node("Mul", ["cap", f"{out}b"], [out])]
        else:
            nodes.append(helper.make_node("Add", [last, "bias"], [out]))
        last = out
    nodes.append(helper.make_node("Identity", [last], ["logits"]))
    return model(
        nodes,
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", FLOAT, [1, "T", 10])],
        inits,
        opset=21 if qdq else 18,
    )


def test_lm_head_sees_only_the_gathered_rows():
    proto = _lm()
    m = ir.from_proto(proto)
    assert gather_logits(m, vocab_size=10) == 1
    fused = ir.to_proto(m)
    assert [n.op_type for n in fused.graph.node] == ["Gather", "Relu", "Gather", "MatMul", "Identity", "Squeeze"]
    assert [i.name for i in fused.graph.input] == ["input_ids", "logits_indices"]
    ids = np.array([[1, 4, 2, 9, 7]])
    rows = np.array([4, 1])
    (want,) = run(proto, {"input_ids": ids})
    (got,) = run(fused, {"input_ids": ids, "logits_indices": rows})
    assert got.shape == (2, 10)
    np.testing.assert_allclose(got, want[0, rows], atol=1e-6)


def test_a_per_tensor_qdq_in_front_of_the_head_is_gathered_behind():
    """x → Q → DQ → LM head (static per-tensor: elementwise): the rows are gathered before the Q, so the Q/DQ still
    sits right in front of the MatMul for the qmatmul rule; the logits are the original's rows."""
    proto = _lm(qdq=True)
    m = ir.from_proto(proto)
    assert gather_logits(m, vocab_size=10) == 1
    fused = ir.to_proto(m)
    assert [n.op_type for n in fused.graph.node] == ["Gather", "Relu", "Gather", "QuantizeLinear",
                                                     "DequantizeLinear", "MatMul", "Identity", "Squeeze"]
    ids = np.array([[1, 4, 2, 9, 7]])
    rows = np.array([4, 1])
    (want,) = _run_qdq(proto, {"input_ids": ids})
    (got,) = _run_qdq(fused, {"input_ids": ids, "logits_indices": rows})
    np.testing.assert_array_equal(got, want[0, rows])
    h = np.maximum(EMB[ids[0, rows]], 0)  # the same in numpy: gather, Q/DQ, head
    h = np.clip(h / np.float32(0.01), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(0.01)
    np.testing.assert_allclose(got, h @ HEAD, rtol=1e-6, atol=1e-6)


def _run_qdq(proto, feeds):
    """ORT running the graph as written: its graph optimizations off. (With them on, ORT drops the Relu in front
    of the QuantizeLinear, as if the zero point clamped negatives as it does for uint8; an FP8 one does not.)"""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_unknown_lm_head_is_a_fusion_error():
    with pytest.raises(FusionError, match="LM-head MatMul"):
        gather_logits(ir.from_proto(_lm("Einsum")), vocab_size=10)


@pytest.mark.parametrize("tail", [("scale",), ("softcap",), ("scale", "softcap")])
def test_row_wise_scaling_after_the_head_is_kept_and_gathered(tail):
    """Granite divides the logits by `logits_scaling`, Gemma-2 soft-caps them: the rows are gathered before the
    head, the scaling stays after it, and the plan's logits equal the original's rows."""
    proto = _lm(tail=tail)
    m = ir.from_proto(proto)
    assert gather_logits(m, vocab_size=10) == 1
    fused = ir.to_proto(m)
    ops = [n.op_type for n in fused.graph.node]
    assert ops[2:4] == ["Gather", "MatMul"] and ops[-1] == "Squeeze"
    ids = np.array([[1, 4, 2, 9, 7]])
    rows = np.array([3, 0, 3])
    (want,) = run(proto, {"input_ids": ids})
    (got,) = run(fused, {"input_ids": ids, "logits_indices": rows})
    np.testing.assert_allclose(got, want[0, rows], atol=1e-6)


def test_a_vector_operand_after_the_head_is_not_walked_through():
    with pytest.raises(FusionError, match="computed by Add"):
        gather_logits(ir.from_proto(_lm(tail=("mix",))), vocab_size=10)
