"""The torch executor's QMatMul rewrite (runtime/executors/qmatmul_packing.py): a converted graph of trtopt.QMatMul
nodes (FP8 and INT4/UINT4 weights, every activation mode, a shared weight, a weight that is a graph input) packed
once with CUDA faked, against the unrewritten graph. Without CUDA the GEMV runs under the Triton interpreter (set
here before the kernel module is imported); the `gpu` test repeats it on CUDA, bit for bit."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from trtopt.plugins.qmatmul.kernel import MAX_ROWS  # noqa: E402
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC  # noqa: E402
from trtopt.runtime.executors import qmatmul_packing, trtopt_ops  # noqa: E402
from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch  # noqa: E402

K = 128
RNG = np.random.default_rng(0)
FP8 = ml_dtypes.float8_e4m3fn


def _fp8(n: int):
    w = RNG.standard_normal((K, n)).astype(np.float32)
    scale = (np.abs(w).max(0) / 448).astype(np.float32)
    return (w / scale).astype(FP8), scale, np.zeros(n, FP8), dict(axis=1, block_size=0,
                                                                  weight_dtype=TensorProto.FLOAT8E4M3FN)


def _int4(n: int, group: int, signed: bool):
    lo, hi, dtype, onnx_dtype = (-8, 8, ml_dtypes.int4, TensorProto.INT4) if signed else \
        (0, 16, ml_dtypes.uint4, TensorProto.UINT4)
    scale = (RNG.random((K // group, n)) * 0.1 + 0.01).astype(np.float32)
    zp = (np.zeros((K // group, n)) if signed else RNG.integers(lo, hi, (K // group, n))).astype(dtype)
    return RNG.integers(lo, hi, (K, n)).astype(dtype), scale, zp, dict(axis=0, block_size=group,
                                                                       weight_dtype=onnx_dtype)


def _model() -> tuple[ir.Model, int]:
    """y_i = QMatMul(x, weight_i): FP8 weight-only, FP8 with static and dynamic (scale a graph input) activation
    Q/DQ, symmetric INT4 and asymmetric UINT4, the INT4 weight again on x2, and an FP8 weight that is a graph input
    (not packed). Returns the model and the calls that read constant weights."""
    weights = {"f8": _fp8(24), "i4": _int4(13, 32, True), "u4": _int4(9, 64, False)}
    inits = [("act_one", np.asarray(1.0, np.float32)), ("act_s", np.asarray(0.02, np.float32)),
             ("act_zp", np.zeros((), FP8)), ("no", np.asarray(False)), ("yes", np.asarray(True))]
    for name, (w, s, z, _) in weights.items():
        inits += [(f"{name}_w", w), (f"{name}_s", s), (f"{name}_z", z)]
    # (x, weight, act_mode, act_scale) per output
    calls = [("x", "f8", ACT_NONE, "act_one"), ("x", "f8", ACT_STATIC, "act_s"), ("x", "f8", ACT_DYNAMIC, "dyn_s"),
             ("x", "i4", ACT_NONE, "act_one"), ("x", "u4", ACT_NONE, "act_one"), ("x2", "i4", ACT_NONE, "act_one")]
    nodes, outputs = [], []
    for i, (x, name, mode, act_scale) in enumerate(calls):
        flags = ["no", "no"] if mode == ACT_NONE else ["yes", "yes" if mode == ACT_STATIC else "no"]
        nodes.append(helper.make_node(
            "QMatMul", [x, f"{name}_w", f"{name}_s", f"{name}_z", act_scale, "act_zp", *flags], [f"y{i}"],
            domain="trtopt", act_mode=mode, act_block_size=K if mode == ACT_DYNAMIC else 0, **weights[name][3]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    fp8_attrs = weights["f8"][3]
    nodes.append(helper.make_node("QMatMul", ["x", "w_in", "f8_s", "f8_z", "act_one", "act_zp", "no", "no"],
                                  ["y_in"], domain="trtopt", **fp8_attrs))
    outputs.append(helper.make_tensor_value_info("y_in", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", K]),
              helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["B", "T", K]),
              helper.make_tensor_value_info("dyn_s", TensorProto.FLOAT, ["B", "T", 1]),
              helper.make_tensor_value_info("w_in", TensorProto.FLOAT8E4M3FN, [K, 24])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("trtopt", 1)],
                              ir_version=10)
    return ir.from_proto(proto), len(calls)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_cpu_graphs_keep_the_op():
    model, _ = _model()
    gm = onnx_to_torch(model).module
    assert qmatmul_packing.pack_qmatmul_weights(gm) == 0
    assert _targets(gm).count(trtopt_ops.qmatmul) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA for CPU tensors under the Triton interpreter")
def test_constant_weights_are_packed_once_and_compute_the_same(monkeypatch):
    model, constant_calls = _model()
    want_gm = onnx_to_torch(model).module
    gm = onnx_to_torch(model).module
    monkeypatch.setattr(qmatmul_packing, "_on_gpu", lambda t: True)
    assert qmatmul_packing.pack_qmatmul_weights(gm) == constant_calls
    targets = _targets(gm)
    assert targets.count(qmatmul_packing.qmatmul_packed_call) == constant_calls
    assert targets.count(trtopt_ops.qmatmul) == 1  # the graph input's weight
    buffers = dict(gm.named_buffers())
    packed = [name for name in buffers if "_packed_data" in name]
    assert len(packed) == 3  # f8, i4 (read twice, packed once), u4
    assert sum("_packed_zero" in name for name in buffers) == 1  # UINT4 with zero points; INT4's are a constant
    assert {buffers[name].dtype for name in packed} == {torch.uint8, torch.int32}
    # The plan's INT4/UINT4 buffers (one byte a value) are gone; the FP8 scale stays: the graph input's call reads it.
    assert not any(t.dtype in (torch.int8, torch.uint8) and t.shape[0] == K for t in buffers.values())
    w_in = torch.from_numpy((RNG.standard_normal((K, 24)) * 20).astype(np.float32)).to(torch.float8_e4m3fn)
    for rows in (1, 5, MAX_ROWS + 3):  # the GEMV, and the dequantize + GEMM path past MAX_ROWS
        x = torch.randn(1, rows, K, generator=torch.Generator().manual_seed(rows))
        dyn_s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
        got, want = gm(x, -x, dyn_s, w_in), want_gm(x, -x, dyn_s, w_in)
        assert len(got) == len(want) == constant_calls + 1
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_packed_graph_on_cuda_equals_the_op():
    """On CUDA the unrewritten op packs per call (qmatmul_triton) and runs the same GEMV: bit for bit up to MAX_ROWS
    rows; past it both dequantize and multiply in fp32 (the GEMM may pick another algorithm for the transposed
    weight: fp32 rounding)."""
    model, constant_calls = _model()
    want_gm = onnx_to_torch(model, device="cuda").module
    gm = onnx_to_torch(model, device="cuda").module
    assert qmatmul_packing.pack_qmatmul_weights(gm) == constant_calls
    w_in = torch.from_numpy((RNG.standard_normal((K, 24)) * 20).astype(np.float32)).to("cuda", torch.float8_e4m3fn)
    for rows in (1, 5, 12, MAX_ROWS, MAX_ROWS + 3):
        x = torch.randn(1, rows, K, generator=torch.Generator().manual_seed(rows)).cuda()
        dyn_s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
        for a, b in zip(gm(x, -x, dyn_s, w_in), want_gm(x, -x, dyn_s, w_in)):
            if rows <= MAX_ROWS:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
