"""The Q/DQ graphs `trtopt quantize` writes: valid ONNX, the expected nodes, and logits equal to an independent
numpy fake-quant reference of the same weights (activations fake-quantized with Cast, not Q/DQ) on ORT."""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize.runner import OrtCausalLM
from trtopt.signature import LOGITS

FAST = dict(calibration_sequences=2, calibration_length=64)  # the data.py rule, on fewer tokens
CONFIGS = {
    "int4_sym_g32": QuantizeConfig(weights="int4", group_size=32),
    "int4_asym_g32": QuantizeConfig(weights="int4", group_size=32, asymmetric=True),
    "fp8_weight_only": QuantizeConfig(weights="fp8"),
    "fp8_w8a8_static": QuantizeConfig(weights="fp8", activations="fp8", **FAST),
    "fp8_w8a8_dynamic": QuantizeConfig(weights="fp8", activations="fp8", activation_scales="dynamic"),
}

TOKENS = [1, 504, 3399, 314, 260, 1345, 30, 2, 17, 9000, 41, 77, 4000, 5, 6, 7]
LAYERS, MATMULS_PER_LAYER, ACTIVATIONS_PER_LAYER = 2, 7, 4  # tiny-llama: q k v o gate up down; 4 distinct inputs


@pytest.fixture(scope="module")
def quantized(tiny_export, module_tmp):
    """quantized(name) -> QuantizeResult of CONFIGS[name] on the tiny-llama export, once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = quantize_model(tiny_export, module_tmp / name, CONFIGS[name], force=True)
        return cache[name]

    return get


def _fake_weight(w: np.ndarray, name: str) -> np.ndarray:
    """The test's own formulas (not trtopt.quantize.methods)."""
    if name.startswith("fp8"):
        s = np.abs(w).max(0) / 448
        return (w / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    g = 32
    wg = w.reshape(w.shape[0] // g, g, w.shape[1])
    if "asym" in name:
        lo, hi = wg.min(1, keepdims=True), wg.max(1, keepdims=True)
        s = (hi - lo) / 15
        z = np.clip(np.round(-lo / s), 0, 15)
        return ((np.clip(np.round(wg / s) + z, 0, 15) - z) * s).reshape(w.shape)
    s = np.abs(wg).max(1, keepdims=True) / 7
    return (np.clip(np.round(wg / s), -8, 7) * s).reshape(w.shape)


def _reference(export: onnx.ModelProto, result, name: str) -> onnx.ModelProto:
    """The float export with fake-quantized weights and, for W8A8, Cast-based activation fake-quant."""
    model = onnx.version_converter.convert_version(export, 21)
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for node_name in result.quantized:
        t = inits[nodes[node_name].input[1]]
        t.CopyFrom(numpy_helper.from_array(_fake_weight(numpy_helper.to_array(t), name).astype(np.float32), t.name))
    if "w8a8" not in name:
        return model
    new_nodes, fq = [], {}
    for node in model.graph.node:
        if node.name in result.quantized:
            x = node.input[0]
            if x not in fq:
                fq[x] = x + "_ref_fq"
                if "static" in name:
                    model.graph.initializer.append(numpy_helper.from_array(
                        np.asarray(result.activation_scales[x], np.float32), x + "_ref_s"))
                    s = x + "_ref_s"
                else:
                    for suffix, arr in (("_ref_axes", np.array([-1], np.int64)), ("_ref_448", np.float32(448)),
                                        ("_ref_tiny", np.float32(2.0 ** -24))):
                        model.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), x + suffix))
                    s = x + "_ref_s"
                    new_nodes += [helper.make_node("Abs", [x], [x + "_ref_abs"]),
                                  helper.make_node("ReduceMax", [x + "_ref_abs", x + "_ref_axes"], [x + "_ref_max"]),
                                  helper.make_node("Div", [x + "_ref_max", x + "_ref_448"], [x + "_ref_r"]),
                                  helper.make_node("Max", [x + "_ref_r", x + "_ref_tiny"], [s])]
                new_nodes += [helper.make_node("Div", [x, s], [x + "_ref_div"]),
                              helper.make_node("Cast", [x + "_ref_div"], [x + "_ref_f8"], to=TensorProto.FLOAT8E4M3FN),
                              helper.make_node("Cast", [x + "_ref_f8"], [x + "_ref_f32"], to=TensorProto.FLOAT),
                              helper.make_node("Mul", [x + "_ref_f32", s], [fq[x]])]
            node.input[0] = fq[x]
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_graph_is_valid_and_matches_the_fake_quant_reference(name, quantized, tiny_export):
    result = quantized(name)
    model = onnx.load(str(result.model_path))
    onnx.checker.check_model(model, full_check=True)
    assert result.opset == (19 if name in ("fp8_weight_only", "fp8_w8a8_static") else 21)
    assert len(result.quantized) == LAYERS * MATMULS_PER_LAYER
    assert list(result.skipped.values()) == ["LM head (kept high precision)"]
    ops = Counter(n.op_type for n in model.graph.node)
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("/weight_dq")]
    assert len(weight_dq) == LAYERS * MATMULS_PER_LAYER  # one DQ per quantized weight
    acts = LAYERS * ACTIVATIONS_PER_LAYER if "w8a8" in name else 0
    assert ops["QuantizeLinear"] == acts and ops["DequantizeLinear"] == len(weight_dq) + acts
    inits = {t.name: t for t in model.graph.initializer}
    want = {"int4_sym": TensorProto.INT4, "int4_asym": TensorProto.UINT4, "fp8": TensorProto.FLOAT8E4M3FN}
    for dq in weight_dq:
        codes, scale = inits[dq.input[0]], inits[dq.input[1]]
        assert codes.data_type == want[name.rsplit("_", 1)[0] if name.startswith("int4") else "fp8"]
        attrs = {a.name: a.i for a in dq.attribute}
        k, n = codes.dims
        if name.startswith("int4"):
            assert attrs == {"axis": 0, "block_size": 32} and list(scale.dims) == [k // 32, n]
            assert (len(dq.input) == 3) == ("asym" in name)
        else:
            assert attrs == {"axis": 1} and list(scale.dims) == [n]
        assert (numpy_helper.to_array(scale) > 0).all()
    if "dynamic" in name:
        q = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
        assert all({a.name for a in n.attribute} >= {"axis", "block_size", "output_dtype"} for n in q)

    logits = OrtCausalLM(result.model_path).run(TOKENS)[LOGITS.name]
    export = onnx.load(str(tiny_export / "model.onnx"))
    reference = OrtCausalLM(_reference(export, result, name)).run(TOKENS)[LOGITS.name]
    float_logits = OrtCausalLM(tiny_export / "model.onnx").run(TOKENS)[LOGITS.name]
    assert np.abs(logits - float_logits).max() > 1e-3  # the quantization did something
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_the_quantized_model_dir_has_the_tokenizer_and_config(quantized, tiny_export):
    out = quantized("int4_sym_g32").out_dir
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_export / name).read_bytes()
