"""fusion_passes/qmatmul.py: every Q/DQ form collapses into one trtopt.QMatMul whose body equals the Q/DQ graph on
ORT; forms that are not understood stay as plain ops with a reason; broken quantizations are FusionErrors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from graphs import FLOAT, model, op_types
from onnx import TensorProto, helper

from trtopt.errors import FusionError
from trtopt.fusion_passes.qmatmul import fuse_qmatmul
from trtopt.fusion_passes.trace import Trace
from trtopt.plugins import attach_functions
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC

RNG = np.random.default_rng(0)
K, N = 256, 24  # K·N > cleanup's fold limit, K a multiple of 128
FP8 = ml_dtypes.float8_e4m3fn


def session(proto: onnx.ModelProto) -> ort.InferenceSession:
    """ORT with its QDQ fusions off (as trtopt quantize and the ORT executor run Q/DQ graphs)."""
    proto = attach_functions(proto)
    onnx.checker.check_model(proto, full_check=True)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def fp8_weight():
    w = RNG.standard_normal((K, N)).astype(np.float32)
    scale = (np.abs(w).max(0) / 448).astype(np.float32)
    return (w / scale).astype(FP8), scale, None, {"axis": 1}


def int4_weight(group: int, asym: bool):
    w = RNG.standard_normal((K, N)).astype(np.float32)
    scale = (RNG.random((K // group, N)) * 0.1 + 0.01).astype(np.float32)
    if asym:
        codes = RNG.integers(0, 16, (K, N)).astype(ml_dtypes.uint4)
        return codes, scale, RNG.integers(0, 16, (K // group, N)).astype(ml_dtypes.uint4), \
            {"axis": 0, "block_size": group}
    del w
    return RNG.integers(-8, 8, (K, N)).astype(ml_dtypes.int4), scale, None, {"axis": 0, "block_size": group}


def qdq_graph(weight, act: str, *, opset: int = 21, extra_inits=()) -> onnx.ModelProto:
    codes, scale, zp, attrs = weight
    inits = [("w_q", codes), ("w_s", scale), *([("w_zp", zp)] if zp is not None else []), *extra_inits]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s", *(["w_zp"] if zp is not None else [])], ["w"],
                              name="w_dq", **attrs)]
    x = "x"
    if act == "static":
        inits += [("a_s", np.asarray(0.01, np.float32)), ("a_zp", np.zeros((), FP8))]
        nodes += [helper.make_node("QuantizeLinear", ["x", "a_s", "a_zp"], ["xq"], name="act_q"),
                  helper.make_node("DequantizeLinear", ["xq", "a_s", "a_zp"], ["xdq"], name="act_dq")]
        x = "xdq"
    elif act == "dynamic":  # as trtopt/quantize/qdq.py writes it
        inits += [("axes", np.array([-1], np.int64)), ("fmax", np.asarray(448.0, np.float32)),
                  ("tiny", np.asarray(2.0 ** -24, np.float32))]
        nodes += [helper.make_node("Abs", ["x"], ["ab"]), helper.make_node("ReduceMax", ["ab", "axes"], ["am"]),
                  helper.make_node("Div", ["am", "fmax"], ["ra"]), helper.make_node("Max", ["ra", "tiny"], ["sc"]),
                  helper.make_node("QuantizeLinear", ["x", "sc"], ["xq"], axis=-1, block_size=K,
                                   output_dtype=TensorProto.FLOAT8E4M3FN, name="act_q"),
                  helper.make_node("DequantizeLinear", ["xq", "sc"], ["xdq"], axis=-1, block_size=K, name="act_dq")]
        x = "xdq"
    nodes.append(helper.make_node("MatMul", [x, "w"], ["y"], name="proj"))
    return model(nodes, [helper.make_tensor_value_info("x", FLOAT, ["B", "T", K])],
                 [helper.make_tensor_value_info("y", FLOAT, ["B", "T", N])], inits, opset=opset)


def fuse(proto: onnx.ModelProto, trace: Trace | None = None) -> tuple[int, onnx.ModelProto]:
    m = ir.from_proto(proto)
    count = fuse_qmatmul(m, trace)
    return count, ir.to_proto(m)


FORMS = {
    "fp8_w8a8_static": (fp8_weight, "static", ACT_STATIC),
    "fp8_w8a8_dynamic": (fp8_weight, "dynamic", ACT_DYNAMIC),
    "fp8_weight_only": (fp8_weight, "none", ACT_NONE),
    "int4_sym_g32": (lambda: int4_weight(32, False), "none", ACT_NONE),
    "int4_asym_g128": (lambda: int4_weight(128, True), "none", ACT_NONE),
}


@pytest.mark.parametrize("form,opset", [*((f, 21) for f in FORMS), ("fp8_w8a8_static", 19), ("fp8_weight_only", 19)])
def test_form_fuses_once_and_equals_the_qdq_graph_on_ort(form, opset):
    make_weight, act, mode = FORMS[form]
    proto = qdq_graph(make_weight(), act, opset=opset)
    count, fused = fuse(proto)
    assert count == 1
    qm = [n for n in fused.graph.node if n.op_type == "QMatMul"]
    assert len(qm) == 1 and qm[0].domain == "trtopt"
    attrs = {a.name: helper.get_attribute_value(a) for a in qm[0].attribute}
    assert attrs["act_mode"] == mode and "plugin_namespace" not in attrs
    assert "MatMul" not in op_types(fused) and "QuantizeLinear" not in op_types(fused)
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    want = session(proto).run(None, {"x": x})[0]
    got = session(fused).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)  # the body is the Q/DQ graph: bit for bit


def modelopt_fp8_graph(w: np.ndarray, scale: np.ndarray) -> onnx.ModelProto:
    """ModelOpt's FP8 form (`python -m modelopt.onnx.quantization --quantize_mode fp8 --high_precision_dtype fp32`,
    read off its output for a tiny-llama export): the fp32 weight stays a constant and is quantized in the graph,
    QuantizeLinear(w, scale [N], E4M3FN zero point, axis=1) → DequantizeLinear → MatMul, with a static
    per-tensor activation Q/DQ."""
    zp = np.zeros(scale.shape, FP8)
    nodes = [helper.make_node("QuantizeLinear", ["w", "w_s", "w_zp"], ["wq"], name="w_q", axis=1),
             helper.make_node("DequantizeLinear", ["wq", "w_s", "w_zp"], ["wdq"], name="w_dq", axis=1),
             helper.make_node("QuantizeLinear", ["x", "a_s", "a_zp"], ["xq"], name="act_q"),
             helper.make_node("DequantizeLinear", ["xq", "a_s", "a_zp"], ["xdq"], name="act_dq"),
             helper.make_node("MatMul", ["xdq", "wdq"], ["y"], name="proj")]
    inits = [("w", w), ("w_s", scale), ("w_zp", zp), ("a_s", np.asarray(0.01, np.float32)),
             ("a_zp", np.zeros((), FP8))]
    return model(nodes, [helper.make_tensor_value_info("x", FLOAT, ["B", "T", K])],
                 [helper.make_tensor_value_info("y", FLOAT, ["B", "T", N])], inits, opset=21)


def test_modelopt_fp8_weight_quantized_in_the_graph_folds_bit_for_bit():
    """The rule folds QuantizeLinear(constant weight) into its codes first: the same codes as ORT's QuantizeLinear
    (values at the rounding ties and past ±448 included), so the fused plan equals ModelOpt's graph on ORT exactly."""
    w = (RNG.standard_normal((K, N)) * 3).astype(np.float32)
    scale = (np.abs(w).max(0) / 448).astype(np.float32)
    # values on E4M3 rounding ties (between 1 and 1.125, 1.125 and 1.25) and past the largest code
    w[:4, 0] = np.array([1.0625, 1.1875, 500.0, -1e4], np.float32) * scale[0]
    proto = modelopt_fp8_graph(w, scale)
    count, fused = fuse(proto)
    assert count == 1 and "QuantizeLinear" not in op_types(fused) and "MatMul" not in op_types(fused)
    qm = next(n for n in fused.graph.node if n.op_type == "QMatMul")
    assert {a.name: helper.get_attribute_value(a) for a in qm.attribute}["act_mode"] == ACT_STATIC
    codes = onnx.numpy_helper.to_array(next(t for t in fused.graph.initializer if t.name == qm.input[1]))
    q_only = model([helper.make_node("QuantizeLinear", ["w", "w_s", "w_zp"], ["wq"], axis=1)], [],
                   [helper.make_tensor_value_info("wq", TensorProto.FLOAT8E4M3FN, [K, N])],
                   [("w", w), ("w_s", scale), ("w_zp", np.zeros(scale.shape, FP8))], opset=21)
    ort_codes = session(q_only).run(None, {})[0]
    np.testing.assert_array_equal(codes.view(np.uint8), np.asarray(ort_codes).view(np.uint8))
    assert float(codes[2, 0]) == 448.0 and float(codes[3, 0]) == -448.0  # saturated, not NaN
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_array_equal(session(fused).run(None, {"x": x})[0], session(proto).run(None, {"x": x})[0])


def test_a_quantize_of_a_weight_read_by_something_else_is_not_folded():
    w = RNG.standard_normal((K, N)).astype(np.float32)
    proto = modelopt_fp8_graph(w, (np.abs(w).max(0) / 448).astype(np.float32))
    proto.graph.node.append(helper.make_node("Cast", ["wq"], ["wq_f"], to=TensorProto.FLOAT))
    proto.graph.output.append(helper.make_tensor_value_info("wq_f", FLOAT, [K, N]))
    trace = Trace()
    count, fused = fuse(proto, trace)
    assert count == 0 and "QuantizeLinear" in op_types(fused)
    assert any("not a constant" in f.reason for f in trace.failures)


def test_shared_static_activation_qdq_feeds_three_projections():
    """Q/K/V share one activation Q/DQ: three QMatMuls, and the shared Q/DQ goes once nothing reads it."""
    codes, scale, _, attrs = fp8_weight()
    proto = qdq_graph((codes, scale, None, attrs), "static")
    g = proto.graph
    for i in (1, 2):
        g.node.insert(0, helper.make_node("DequantizeLinear", [f"w_q{i}", "w_s"], [f"w{i}"], axis=1))
        g.initializer.append(onnx.numpy_helper.from_array(codes, f"w_q{i}"))
        g.node.append(helper.make_node("MatMul", ["xdq", f"w{i}"], [f"y{i}"], name=f"proj{i}"))
        g.output.append(helper.make_tensor_value_info(f"y{i}", FLOAT, ["B", "T", N]))
    count, fused = fuse(proto)
    assert count == 3 and op_types(fused).count("QMatMul") == 3 and "QuantizeLinear" not in op_types(fused)
    x = RNG.standard_normal((1, 5, K)).astype(np.float32)
    for got, want in zip(session(fused).run(None, {"x": x}), session(proto).run(None, {"x": x})):
        np.testing.assert_array_equal(got, want)  # the body is the Q/DQ graph: bit for bit


def test_ort_matmul_nbits_quantizer_qdq_output_fuses():
    quantization = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    from onnxruntime.quantization import QuantFormat

    w = RNG.standard_normal((K, N)).astype(np.float32)
    proto = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
                  [helper.make_tensor_value_info("x", FLOAT, ["B", "T", K])],
                  [helper.make_tensor_value_info("y", FLOAT, ["B", "T", N])], [("w", w)], opset=21)
    config = quantization.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, quant_format=QuantFormat.QDQ)
    quantizer = quantization.MatMulNBitsQuantizer(proto, algo_config=config)
    quantizer.process()
    qdq = quantizer.model.model
    assert "DequantizeLinear" in op_types(qdq)
    count, fused = fuse(qdq)
    assert count == 1 and op_types(fused) == ["QMatMul"]
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_allclose(session(fused).run(None, {"x": x})[0], session(qdq).run(None, {"x": x})[0],
                               atol=1e-4, rtol=0)


def _nbits_model(*, symmetric: bool, opset: int = 21, **config) -> onnx.ModelProto:
    quantization = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    w = RNG.standard_normal((K, N)).astype(np.float32)
    proto = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
                  [helper.make_tensor_value_info("x", FLOAT, ["B", "T", K])],
                  [helper.make_tensor_value_info("y", FLOAT, ["B", "T", N])], [("w", w)], opset=opset)
    algo = quantization.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, **config)
    quantizer = quantization.MatMulNBitsQuantizer(proto, algo_config=algo)
    quantizer.process()
    return quantizer.model.model


@pytest.mark.parametrize("symmetric", [True, False])
def test_ort_matmul_nbits_default_form_is_repacked_into_qmatmul(symmetric):
    nbits = _nbits_model(symmetric=symmetric)
    assert op_types(nbits) == ["MatMulNBits"] and (len(nbits.graph.node[0].input) == 4) != symmetric
    count, fused = fuse(nbits)
    assert count == 1 and op_types(fused) == ["QMatMul"]
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    # MatMulNBits accumulates in its own order: equal within 1e-4, not bitwise.
    np.testing.assert_allclose(session(fused).run(None, {"x": x})[0], session(nbits).run(None, {"x": x})[0],
                               atol=1e-4, rtol=1e-5)


def test_ort_matmul_nbits_outside_the_repacked_form_stays_with_a_reason():
    nbits = _nbits_model(symmetric=True, accuracy_level=4)  # int8 activations: not a Q/DQ meaning
    trace = Trace()
    count, fused = fuse(nbits, trace)
    assert count == 0 and op_types(fused) == ["MatMulNBits"]
    assert "accuracy_level=4" in trace.failures[0].reason


@pytest.mark.parametrize("case", ["per_tensor_fp8", "int4_per_channel", "non_constant_weight", "int8_weight"])
def test_unsupported_forms_stay_plain_with_a_reason(case):
    if case == "per_tensor_fp8":
        codes, scale, _, _ = fp8_weight()
        proto = qdq_graph((codes, np.asarray(scale.max(), np.float32), None, {}), "none")
    elif case == "int4_per_channel":
        codes, scale, _, _ = int4_weight(32, False)
        proto = qdq_graph((codes, scale[0], None, {"axis": 1}), "none")
    elif case == "int8_weight":
        proto = qdq_graph((RNG.integers(-128, 127, (K, N)).astype(np.int8), np.full(N, 0.1, np.float32), None,
                           {"axis": 1}), "none")
    else:
        proto = qdq_graph(fp8_weight(), "none")
        proto.graph.input.append(helper.make_tensor_value_info("w_q", TensorProto.FLOAT8E4M3FN, [K, N]))
        keep = [t for t in proto.graph.initializer if t.name != "w_q"]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(keep)
    trace = Trace()
    count, fused = fuse(proto, trace)
    assert count == 0 and op_types(fused) == op_types(proto)
    assert len(trace.failures) == 1 and trace.failures[0].rule == "qmatmul" and trace.failures[0].anchor == "proj"


def test_int8_activation_qdq_stays_and_the_weight_still_fuses():
    codes, scale, _, attrs = fp8_weight()
    proto = qdq_graph((codes, scale, None, attrs), "none",
                      extra_inits=[("a_s", np.asarray(0.05, np.float32)), ("a_zp", np.zeros((), np.int8))])
    g = proto.graph
    g.node.insert(1, helper.make_node("QuantizeLinear", ["x", "a_s", "a_zp"], ["xq"], name="act_q"))
    g.node.insert(2, helper.make_node("DequantizeLinear", ["xq", "a_s", "a_zp"], ["xdq"], name="act_dq"))
    g.node[-1].input[0] = "xdq"
    trace = Trace()
    count, fused = fuse(proto, trace)
    assert count == 1 and op_types(fused) == ["QuantizeLinear", "DequantizeLinear", "QMatMul"]
    assert "INT8" in trace.failures[0].reason
    x = RNG.standard_normal((1, 4, K)).astype(np.float32)
    np.testing.assert_allclose(session(fused).run(None, {"x": x})[0], session(proto).run(None, {"x": x})[0],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["zero_weight_scale", "nan_weight_scale", "negative_activation_scale",
                                  "block_not_dividing_k"])
def test_broken_quantization_is_a_one_line_fusion_error(case):
    codes, scale, _, attrs = fp8_weight()
    if case == "block_not_dividing_k":
        codes, _, _, _ = int4_weight(32, False)
        proto = qdq_graph((codes, np.full((6, N), 0.1, np.float32), None, {"axis": 0, "block_size": 48}), "none")
    elif case == "negative_activation_scale":
        proto = qdq_graph((codes, scale, None, attrs), "static")
        next(t for t in proto.graph.initializer if t.name == "a_s").CopyFrom(
            onnx.numpy_helper.from_array(np.asarray(-0.01, np.float32), "a_s"))
    else:
        scale[3] = 0.0 if case == "zero_weight_scale" else np.nan
        proto = qdq_graph((codes, scale, None, attrs), "none")
    with pytest.raises(FusionError) as err:
        fuse(proto)
    assert "\n" not in str(err.value) and "re-quantize" in str(err.value)


def test_negative_weight_scales_fuse_and_stay_exact():
    codes, scale, zp, attrs = int4_weight(32, False)
    scale[::2] *= -1  # as ORT's symmetric quantizer writes them
    proto = qdq_graph((codes, scale, zp, attrs), "none")
    count, fused = fuse(proto)
    assert count == 1
    x = RNG.standard_normal((1, 2, K)).astype(np.float32)
    np.testing.assert_array_equal(session(fused).run(None, {"x": x})[0], session(proto).run(None, {"x": x})[0])


# ---- end to end: tiny-llama quantized by trtopt quantize, built, run ---------------------------------------------

E2E_CONFIGS = {
    "fp8_w8a8_static": dict(weights="fp8", activations="fp8", calibration_sequences=2, calibration_length=64),
    "fp8_w8a8_dynamic": dict(weights="fp8", activations="fp8", activation_scales="dynamic"),
    "fp8_weight_only": dict(weights="fp8"),
    "int4_sym_g32": dict(weights="int4", group_size=32),
    "int4_asym_g32": dict(weights="int4", group_size=32, asymmetric=True),
}


@pytest.mark.parametrize("name", list(E2E_CONFIGS))
def test_quantized_tiny_llama_builds_and_its_greedy_tokens_equal_the_qdq_graph(name, export_dir, tmp_path):
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import read_plan
    from trtopt.check.compare import Tolerance
    from trtopt.check.original import OriginalModel
    from trtopt.check.runner import ORIGINAL, Workload, compare_executors
    from trtopt.quantize import QuantizeConfig, quantize_model
    from trtopt.runtime.executors import create_executor

    qdir = tmp_path / "q"
    quantize_model(export_dir("tiny-llama"), qdir, QuantizeConfig(**E2E_CONFIGS[name]), force=True)
    graph = onnx.load(qdir / "model.onnx", load_external_data=False).graph
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    projections = sum(n.op_type == "MatMul" and n.input[1] in dequantized for n in graph.node)
    built = build_plan(qdir, tmp_path / "plan", force=True, progress=False)
    assert built.report.counts["qmatmul"] == projections >= 14  # q k v o gate up down in 2 layers
    # Q/K/V and gate/up QMatMuls concatenate (tests/fusion_passes/test_qmatmul_horizontal.py).
    assert built.report.counts["horizontal_matmul"] == 2 * built.config.model.num_layers
    # SwiGLU still fuses: gate and up are the two halves of the fused QMatMul's Split.
    assert built.report.counts["silu_mul"] == built.config.model.num_layers
    plan_proto = onnx.load(built.plan_dir / "model.onnx", load_external_data=False)
    kinds = {n.op_type for n in plan_proto.graph.node}
    assert "QMatMul" in kinds and "DequantizeLinear" not in kinds and "QuantizeLinear" not in kinds
    initializers = {t.name for t in plan_proto.graph.initializer}
    for node in plan_proto.graph.node:
        if node.op_type == "QMatMul":  # TensorRT inlines the body and must see the If conditions as weights
            assert node.input[6] in initializers and node.input[7] in initializers
            assert all(a.name != "plugin_namespace" for a in node.attribute)

    plan = read_plan(built.plan_dir)
    executors = {b: create_executor(b, built.plan_dir, plan, num_blocks=24) for b in ("torch", "onnxruntime")}
    rng = np.random.default_rng(0)
    prompts = tuple(tuple(rng.integers(0, plan.model.vocab_size, n).tolist()) for n in (21, 6, 1))
    results = compare_executors(plan, executors, Workload(prompts, chunk=8, decode_steps=4),
                                Tolerance(atol=1e-2, rtol=0.0), original=OriginalModel(qdir / "model.onnx", plan.model))
    want = results[ORIGINAL].greedy_tokens
    assert want and all(want)
    for backend in executors:
        assert results[backend].greedy_tokens == want, backend
    assert results["torch"].logits.max_abs <= 1e-2, results["torch"].logits.max_abs
    assert results["onnxruntime"].logits.max_abs <= 1e-4, results["onnxruntime"].logits.max_abs
