"""Searched FP8/INT4 weight quantization: the output-weighted clip search and GPTQ's rounding never lose to absmax
round-to-nearest on a synthetic layer's output error, their codes sit on the format's grid, and `--method gptq`
still writes standard Q/DQ (the same nodes as RTN, per-channel FP8 scales via axis=1)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize.methods import (fp8_clip_search, gptq_fp8, gptq_int4, output_mse, quantize_fp8, quantize_int4)
from trtopt.quantize.runner import OrtCausalLM
from trtopt.signature import LOGITS

FAST = dict(calibration_sequences=2, calibration_length=64)
TOKENS = [1, 504, 3399, 314, 260, 1345, 30, 2, 17, 9000, 41, 77, 4000, 5, 6, 7]


def _layer(seed: int, k: int = 128, n: int = 96):
    """Correlated activations with two outlier channels (as LLM inputs have) and a weight: (w [K, N], H [K, K])."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2048, k)) @ (np.eye(k) + 0.3 * rng.normal(size=(k, k)) / np.sqrt(k))
    x[:, [3, 50]] *= 20.0
    w = rng.normal(size=(k, n)) * rng.uniform(0.01, 0.1, size=n)
    w[rng.integers(0, k, 8), rng.integers(0, n, 8)] *= 8.0  # a few outlier weights stretch absmax
    return w.astype(np.float32), (x.T @ x / len(x)).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_fp8_searches_never_lose_to_absmax(seed):
    w, h = _layer(seed)
    absmax = output_mse(w - quantize_fp8(w).dequantize(), h)
    weighted = quantize_fp8(w, clip_ratio=fp8_clip_search(w, hessian=h))
    diag = lambda q: float((np.diag(h)[:, None] * (w - q.dequantize()) ** 2).sum())  # noqa: E731  its own loss
    assert diag(weighted) <= diag(quantize_fp8(w))
    assert output_mse(w - weighted.dequantize(), h) < absmax
    plain = quantize_fp8(w, clip_ratio=fp8_clip_search(w))  # the weight-MSE search minimises its own loss
    assert ((w - plain.dequantize()) ** 2).sum() <= ((w - quantize_fp8(w).dequantize()) ** 2).sum()
    for ratio in (None, fp8_clip_search(w, hessian=h)):
        q = gptq_fp8(w, h, clip_ratio=ratio)
        rtn = quantize_fp8(w, clip_ratio=ratio)
        np.testing.assert_array_equal(q.scale, rtn.scale)  # GPTQ changes the rounding, never the scales
        assert q.codes.dtype == rtn.codes.dtype and q.group is None
        assert output_mse(w - q.dequantize(), h) <= output_mse(w - rtn.dequantize(), h)
    best = output_mse(w - gptq_fp8(w, h, clip_ratio=fp8_clip_search(w, hessian=h)).dequantize(), h)
    assert best < 0.8 * absmax


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_int4_keeps_the_grid_and_lowers_the_output_error(symmetric):
    w, h = _layer(7)
    rtn = quantize_int4(w, 32, symmetric=symmetric)
    q = gptq_int4(w, 32, h, symmetric=symmetric)
    np.testing.assert_array_equal(q.scale, rtn.scale)
    if not symmetric:
        np.testing.assert_array_equal(q.zero_point.astype(np.int32), rtn.zero_point.astype(np.int32))
    codes = q.codes.astype(np.int32)
    assert codes.min() >= (-8 if symmetric else 0) and codes.max() <= (7 if symmetric else 15)
    assert output_mse(w - q.dequantize(), h) < 0.9 * output_mse(w - rtn.dequantize(), h)


def _dequantized_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """MatMul weight input name -> codes * scale, read from the per-channel FP8 weight DQ nodes."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for dq in model.graph.node:
        if dq.op_type == "DequantizeLinear" and dq.name.endswith("/weight_dq"):
            codes, scale = inits[dq.input[0]], inits[dq.input[1]]
            assert codes.data_type == TensorProto.FLOAT8E4M3FN and len(dq.input) == 2
            assert {a.name: a.i for a in dq.attribute} == {"axis": 1} and list(scale.dims) == [codes.dims[1]]
            out[dq.output[0]] = numpy_helper.to_array(codes).astype(np.float32) * numpy_helper.to_array(scale)
    return out


def test_gptq_writes_standard_qdq(tiny_export, tmp_path):
    rtn = quantize_model(tiny_export, tmp_path / "rtn", QuantizeConfig(weights="fp8", activations="fp8", **FAST))
    gptq = quantize_model(tiny_export, tmp_path / "gptq", QuantizeConfig(weights="fp8", activations="fp8",
                                                                         method="gptq", **FAST))
    assert gptq.opset == rtn.opset == 19 and gptq.quantized == rtn.quantized
    assert gptq.activation_scales == rtn.activation_scales  # same calibration, same per-tensor absmax scales
    model = onnx.load(str(gptq.model_path))
    onnx.checker.check_model(model, full_check=True)
    assert Counter(n.op_type for n in model.graph.node) == Counter(
        n.op_type for n in onnx.load(str(rtn.model_path)).graph.node)
    weights = _dequantized_weights(model)
    assert len(weights) == len(gptq.quantized)

    # the graph means what it stores: weight-only GPTQ == the float graph with codes * scale as weights
    wo = quantize_model(tiny_export, tmp_path / "wo", QuantizeConfig(weights="fp8", method="gptq", **FAST))
    quantized = onnx.load(str(wo.model_path))
    reference = onnx.load(str(tiny_export / "model.onnx"))
    deq = _dequantized_weights(quantized)
    by_node = {n.name: n for n in quantized.graph.node}
    inits = {t.name: t for t in reference.graph.initializer}
    nodes = {n.name: n for n in reference.graph.node}
    for name in wo.quantized:
        t = inits[nodes[name].input[1]]
        t.CopyFrom(numpy_helper.from_array(deq[by_node[name].input[1]], t.name))
    logits = OrtCausalLM(wo.model_path).run(TOKENS)[LOGITS.name]
    np.testing.assert_allclose(logits, OrtCausalLM(reference).run(TOKENS)[LOGITS.name], atol=1e-4, rtol=0)
    assert QuantizeConfig(weights="fp8", method="gptq").describe() == "FP8 weight-only GPTQ + clip search"


def test_cli_defaults_to_gptq_for_fp8_and_rtn_for_int4(tiny_export, tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    fast = ["--calibration-sequences", "2", "--calibration-length", "64"]
    fp8 = CliRunner().invoke(app, ["quantize", str(tiny_export), "-o", str(tmp_path / "fp8"), "--weights", "fp8",
                                   "--activations", "fp8", *fast], env={"COLUMNS": "200"})
    assert fp8.exit_code == 0, fp8.output
    assert "FP8 W8A8 (static) GPTQ + clip search" in fp8.output and "calibrated on 128 tokens" in fp8.output
    int4 = CliRunner().invoke(app, ["quantize", str(tiny_export), "-o", str(tmp_path / "int4"), "--weights", "int4",
                                    "--group-size", "32"], env={"COLUMNS": "200"})
    assert int4.exit_code == 0 and "INT4 sym int4 g32 RTN" in int4.output, int4.output
