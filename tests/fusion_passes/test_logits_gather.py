from __future__ import annotations

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


def _lm(head_op: str = "MatMul"):
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]), helper.make_node("Relu", ["h"], ["hr"])]
    if head_op == "MatMul":
        nodes.append(helper.make_node("MatMul", ["hr", "head"], ["logits"]))
    else:
        nodes.append(helper.make_node("Einsum", ["hr", "head"], ["logits"], equation="btd,dv->btv"))
    return model(
        nodes,
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", FLOAT, [1, "T", 10])],
        [("emb", EMB), ("head", HEAD)],
    )


def test_lm_head_sees_only_the_gathered_rows():
    proto = _lm()
    m = ir.from_proto(proto)
    assert gather_logits(m, vocab_size=10) == 1
    fused = ir.to_proto(m)
    assert [n.op_type for n in fused.graph.node] == ["Gather", "Relu", "Gather", "MatMul", "Squeeze"]
    assert [i.name for i in fused.graph.input] == ["input_ids", "logits_indices"]
    ids = np.array([[1, 4, 2, 9, 7]])
    rows = np.array([4, 1])
    (want,) = run(proto, {"input_ids": ids})
    (got,) = run(fused, {"input_ids": ids, "logits_indices": rows})
    assert got.shape == (2, 10)
    np.testing.assert_allclose(got, want[0, rows], atol=1e-6)


def test_unknown_lm_head_is_a_fusion_error():
    with pytest.raises(FusionError, match="LM-head MatMul"):
        gather_logits(ir.from_proto(_lm("Einsum")), vocab_size=10)
