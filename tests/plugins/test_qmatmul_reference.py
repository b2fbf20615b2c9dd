"""trtopt.QMatMul: the torch reference (and the torch executor's weight loading) against the function body on ORT,
for every weight and activation form, at odd shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trtopt.plugins import attach_functions, make_node
from trtopt.plugins.qmatmul.reference import qmatmul_ref
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC
from trtopt.runtime.executors.onnx_to_torch import ir_tensor_to_torch

RNG = np.random.default_rng(1)
FP8 = ml_dtypes.float8_e4m3fn


def _weights(kind: str, k: int, n: int, group: int):
    if kind == "fp8":
        scale = (RNG.random(n) * 0.01 + 1e-3).astype(np.float32)
        codes = (RNG.standard_normal((k, n)) * 100).astype(FP8)
        return codes, scale, np.zeros(n, FP8), {"axis": 1, "weight_dtype": TensorProto.FLOAT8E4M3FN}
    scale = (RNG.random((k // group, n)) * 0.1 + 0.01).astype(np.float32)
    if kind == "int4":
        return (RNG.integers(-8, 8, (k, n)).astype(ml_dtypes.int4), scale, np.zeros(scale.shape, ml_dtypes.int4),
                {"axis": 0, "block_size": group, "weight_dtype": TensorProto.INT4})
    return (RNG.integers(0, 16, (k, n)).astype(ml_dtypes.uint4), scale,
            RNG.integers(0, 16, scale.shape).astype(ml_dtypes.uint4),
            {"axis": 0, "block_size": group, "weight_dtype": TensorProto.UINT4})


@pytest.mark.parametrize("kind,act", [("fp8", ACT_NONE), ("fp8", ACT_STATIC), ("fp8", ACT_DYNAMIC), ("int4", ACT_NONE),
                                      ("uint4", ACT_NONE)])
@pytest.mark.parametrize("m,k,n,group", [(1, 96, 40, 32), (7, 64, 13, 16), (5, 256, 3, 128)])
def test_reference_matches_the_function_body_on_ort(kind, act, m, k, n, group):
    codes, scale, zp, attrs = _weights(kind, k, n, group)
    x = RNG.standard_normal((1, m, k)).astype(np.float32)
    if act == ACT_DYNAMIC:
        act_scale = np.maximum(np.abs(x).max(-1, keepdims=True) / 448, 2.0 ** -24).astype(np.float32)
        feeds, act_input = {"x": x, "s": act_scale}, [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, m, 1])]
        inits = []
    else:
        act_scale = np.asarray(0.02, np.float32)
        feeds, act_input, inits = {"x": x}, [], [numpy_helper.from_array(act_scale, "s")]
    node = make_node("QMatMul", ["x", "w", "ws", "wz", "s", "az", "quantized", "static"], ["y"], name="qm",
                     act_mode=act, act_block_size=k if act == ACT_DYNAMIC else 0, **attrs)
    inits += [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(scale, "ws"),
              numpy_helper.from_array(zp, "wz"), numpy_helper.from_array(np.zeros((), FP8), "az"),
              numpy_helper.from_array(np.asarray(act != ACT_NONE), "quantized"),
              numpy_helper.from_array(np.asarray(act == ACT_STATIC), "static")]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, m, k]),
                                            *act_input],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, n])], inits)
    proto = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    onnx.checker.check_model(proto, full_check=True)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    want = ort.InferenceSession(proto.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    # Load the initializers the way the torch executor does.
    inits = {v.name: ir_tensor_to_torch(v.const_value) for v in ir.from_proto(proto).graph.initializers.values()}
    s = torch.from_numpy(act_scale) if act == ACT_DYNAMIC else inits["s"]
    got = qmatmul_ref(torch.from_numpy(x), inits["w"], inits["ws"], inits["wz"], s, inits["az"], act_mode=act,
                      act_block_size=k if act == ACT_DYNAMIC else 0, block_size=attrs.get("block_size", 0))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=1e-5)
