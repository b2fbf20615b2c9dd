"""AWQ: the searched per-channel scale lowers the layer output MSE vs RTN when the input has outlier channels, and
moving 1/s into the graph (norm fold or Mul) keeps the float graph exact."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
from onnx import numpy_helper

from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize.graph import find_targets, load_model
from trtopt.quantize.methods import awq_search, output_mse, quantize_int4
from trtopt.quantize.qdq import GraphEdit, write_input_scale
from trtopt.quantize.runner import OrtCausalLM
from trtopt.signature import LOGITS

TOKENS = [1, 504, 3399, 314, 260, 1345, 30, 2, 17, 9000, 41, 77]


def test_awq_beats_rtn_on_a_layer_with_outlier_channels():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 128)).astype(np.float32)
    x[:, [5, 77]] *= 30.0  # salient input channels, as LLM activations have
    w = rng.normal(size=(128, 96)).astype(np.float32)
    hessian = x.T @ x / len(x)
    rtn = lambda v: quantize_int4(v, 32, symmetric=False).dequantize()  # noqa: E731
    found = awq_search([w], np.abs(x).mean(0), hessian, rtn)
    assert found.alpha > 0 and found.awq_mse < 0.7 * found.rtn_mse
    # the reported MSEs are the real output MSEs of x @ W
    direct = float(((x @ w - (x / found.scale) @ rtn(w * found.scale[:, None])) ** 2).mean())
    assert np.isclose(direct, found.awq_mse, rtol=1e-3)
    assert np.isclose(float(((x @ (w - rtn(w))) ** 2).mean()), found.rtn_mse, rtol=1e-3)
    assert np.isclose(output_mse(w - rtn(w), hessian), found.rtn_mse)


def _with_outlier_norm(export, out):
    """The tiny export with input channel 7 of every RMSNorm weight x25: q/k/v and gate/up see an outlier channel."""
    out.mkdir(parents=True, exist_ok=True)
    for f in export.iterdir():
        if f.name != "model.onnx":
            shutil.copy2(f, out / f.name)
    model = onnx.load(str(export / "model.onnx"))
    for t in model.graph.initializer:
        if "layernorm" in t.name or t.name.endswith("norm.weight"):
            gamma = numpy_helper.to_array(t).copy()
            gamma[7] *= 25.0
            t.CopyFrom(numpy_helper.from_array(gamma, t.name))
    onnx.save(model, str(out / "model.onnx"))
    return out


def test_awq_on_a_tiny_model_with_an_outlier_channel(tiny_export, tmp_path):
    src = _with_outlier_norm(tiny_export, tmp_path / "src")
    common = dict(weights="int4", group_size=32, asymmetric=True, calibration_sequences=2, calibration_length=64)
    awq = quantize_model(src, tmp_path / "awq", QuantizeConfig(method="awq", **common))
    assert {g.placement for g in awq.awq} == {"folded", "mul"}  # q/k/v + gate/up fold; o and down get a Mul
    for group in awq.awq:
        assert group.final_mse <= group.awq_mse <= group.rtn_mse
    folded = [g for g in awq.awq if g.placement == "folded"]
    assert all(g.awq_mse < 0.9 * g.rtn_mse for g in folded)  # the outlier channel is where AWQ helps
    model = onnx.load(str(awq.model_path))
    onnx.checker.check_model(model, full_check=True)
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) == len(awq.quantized)
    # closer to the float model than RTN on text it did not calibrate on
    rtn = quantize_model(src, tmp_path / "rtn", QuantizeConfig(**common))
    ref = OrtCausalLM(src / "model.onnx").run(TOKENS)[LOGITS.name]
    err = {r: float(((OrtCausalLM(x.model_path).run(TOKENS)[LOGITS.name] - ref) ** 2).mean())
           for r, x in (("awq", awq), ("rtn", rtn))}
    assert err["awq"] < err["rtn"], err


def test_moving_the_awq_scale_into_the_graph_keeps_it_exact(tiny_export, tmp_path):
    """Weights x s (float, no rounding) and x / s by a norm fold or a Mul: the same logits."""
    model = load_model(tiny_export / "model.onnx")
    targets = find_targets(model)
    edit = GraphEdit(model)
    rng = np.random.default_rng(1)
    placements = []
    by_input: dict[str, list] = {}
    for t in targets.quantize:
        by_input.setdefault(t.activation, []).append(t)
    for tensor, members in by_input.items():
        s = rng.uniform(0.25, 4.0, size=members[0].k).astype(np.float32)
        for t in members:
            init = edit.inits[t.weight]
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * s[:, None], t.weight))
        placements.append(write_input_scale(edit, tensor, [t.node for t in members], s, np.float32))
    edit.commit()
    assert placements.count("folded") == 4 and placements.count("mul") == 4
    onnx.checker.check_model(model)
    got = OrtCausalLM(model).run(TOKENS)[LOGITS.name]
    want = OrtCausalLM(tiny_export / "model.onnx").run(TOKENS)[LOGITS.name]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
