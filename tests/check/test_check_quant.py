"""`trtopt check FLOAT_EXPORT QUANTIZED_PLAN`: a quantized plan is held to a quantization tolerance (top-1 agreement,
mean KL, max |Δ logprob|) instead of the float bar, and --layerwise ranks its decoder layers by the error each adds
alone; a layer given a wrong scale in the Q/DQ graph ranks first."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits
from trtopt.check import run_check
from trtopt.check.compare import QuantStats, QuantTolerance
from trtopt.check.quantized import heldout_tokens, plan_sensitivity
from trtopt.cli.main import app
from trtopt.errors import ConfigError
from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize.sensitivity import group_by_layer, module_paths

FAST = ["onnxruntime-cpu"]
CALIBRATION = dict(calibration_sequences=2, calibration_length=64)
LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
# tiny-llama's weights are random: its next-token distributions are flat, so FP8 rounding flips near-ties that a
# trained model's peaked distributions keep (SmolLM2 FP8 W8A8: README). The KL and log-prob bars keep their defaults.
TINY = QuantTolerance(min_top1=0.6)
BAD_LAYER, BAD_FACTOR = "1", 4.0  # layer 1 (less sensitive than layer 0 when quantized right) gets a 4x weight scale


def _bad_scale_copy(src, out, float_export):
    """The quantized export with layer BAD_LAYER's down_proj weight scale multiplied by BAD_FACTOR: a real, wrong
    Q/DQ graph (as a quantizer that mixed up a scale writes)."""
    shutil.copytree(src, out)
    model = onnx.load(str(out / "model.onnx"))
    paths = module_paths(onnx.load(str(float_export / "model.onnx"), load_external_data=False))  # same node names
    (down,) = [n for n in group_by_layer(paths, list(paths))[BAD_LAYER] if paths[n].endswith("down_proj")]
    scale = next(t for t in model.graph.initializer if t.name == f"{down}.weight_scale")
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(BAD_FACTOR), scale.name))
    onnx.save(model, str(out / "model.onnx"))
    return out


@pytest.fixture(scope="module")
def quant_plan(export_dir, module_tmp):
    """quant_plan(name) -> a plan built from the FP8 W8A8 quantization of tiny-llama ("fp8"), or from the same Q/DQ
    graph with a bad scale in one layer ("bad")."""
    cache = {}

    def get(name: str):
        if name not in cache:
            if "fp8-export" not in cache:
                config = QuantizeConfig(weights="fp8", activations="fp8", **CALIBRATION)
                cache["fp8-export"] = quantize_model(export_dir("tiny-llama"), module_tmp / "fp8-export", config,
                                                     force=True).out_dir
            src = cache["fp8-export"] if name == "fp8" else _bad_scale_copy(cache["fp8-export"], module_tmp / "bad",
                                                                            export_dir("tiny-llama"))
            cache[name] = build_plan(src, module_tmp / f"plan-{name}", limits=LIMITS, force=True,
                                     progress=False).plan_dir
        return cache[name]

    return get


def invoke(*args: str):
    return CliRunner().invoke(app, ["check", *map(str, args)], env={"COLUMNS": "160"})


def test_an_fp8_plan_passes_the_quantization_tolerance_on_text(quant_plan, export_dir):
    report = run_check(quant_plan("fp8"), original=export_dir("tiny-llama"), backends=FAST, quant_tolerance=TINY)
    ort = report.by_name("onnxruntime-cpu")
    assert report.quantized and report.passed and ort.status == "passed"
    assert isinstance(ort.logits, QuantStats) and ort.logits.positions > 40
    assert 0 < ort.logits.mean_kl < TINY.max_kl and ort.logits.top1_agreement >= TINY.min_top1
    assert report.workload.seed is None  # text prompts (held-out windows), not random ids
    assert report.to_dict()["tolerance"]["check"] == "quantization"


def test_an_absurd_tolerance_fails_and_says_which_bound(quant_plan, export_dir, tmp_path):
    result = invoke(export_dir("tiny-llama"), quant_plan("fp8"), "-b", "onnxruntime-cpu", "--min-top1", "0.6",
                    "--max-kl", "1e-9", "--json", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert "quantized float32 plan vs original" in result.output and "mean KL" in result.output
    assert "FAILED" in result.output and "> 1e-09" in result.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["passed"] is False and saved["backends"][1]["logits_error"]["mean_kl"] > 1e-9


def test_layerwise_ranks_the_layer_with_a_bad_scale_first(quant_plan, export_dir, tmp_path):
    result = invoke(export_dir("tiny-llama"), quant_plan("bad"), "-b", "onnxruntime-cpu", "--layerwise",
                    "--json", tmp_path / "r.json")
    assert result.exit_code == 1, result.output  # the bad scale also fails the tolerance
    assert "layer sensitivity of the plan" in result.output
    sensitivity = json.loads((tmp_path / "r.json").read_text())["sensitivity"]
    layers = sensitivity["layers"]
    assert [row["layer"] for row in layers] == [BAD_LAYER, "0"]  # one row per decoder layer, the bad one first
    assert len(layers[0]["nodes"]) == 7 and layers[0]["mean_kl"] > 5 * layers[1]["mean_kl"]
    assert layers[0]["matmuls"][-1].endswith("layers.1.mlp.down_proj")

    text = heldout_tokens(quant_plan("fp8"))[-512:].reshape(2, 256).tolist()
    good = plan_sensitivity(quant_plan("fp8"), export_dir("tiny-llama") / "model.onnx", text)
    assert good.layers[0].layer == "0"  # quantized right, layer 1 is the less sensitive one


def test_quantization_bars_need_a_quantized_plan_and_a_float_original(quant_plan, plan_dir, export_dir):
    with pytest.raises(ConfigError, match="the plan is not quantized"):
        run_check(plan_dir("tiny-llama"), original=export_dir("tiny-llama"), backends=FAST,
                  quant_tolerance=QuantTolerance())
    with pytest.raises(ConfigError, match="no float original was given"):
        run_check(quant_plan("fp8"), quant_tolerance=QuantTolerance())
    with pytest.raises(ConfigError, match="--atol/--rtol are the elementwise bar"):
        run_check(quant_plan("fp8"), original=export_dir("tiny-llama"), backends=FAST, atol=1e-3)
    with pytest.raises(ConfigError, match="--min-top1 is a rate"):
        run_check(quant_plan("fp8"), original=export_dir("tiny-llama"), backends=FAST,
                  quant_tolerance=QuantTolerance(min_top1=2.0))
    with pytest.raises(ConfigError, match="is not quantized .no QMatMul"):
        plan_sensitivity(plan_dir("tiny-llama"), export_dir("tiny-llama") / "model.onnx", [[1, 2, 3]])


def test_quant_stats_metrics():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(6, 50)).astype(np.float32) * 3
    same = QuantStats()
    same.add(ref, ref)
    assert same.passed and same.mean_kl == 0 and same.top1_agreement == 1 and same.max_dlogprob == 0
    got = ref + rng.normal(size=ref.shape).astype(np.float32) * 0.3
    stats = QuantStats()
    stats.add(got, ref)
    lp = ref - np.log(np.exp(ref.astype(np.float64)).sum(-1, keepdims=True))
    lq = got - np.log(np.exp(got.astype(np.float64)).sum(-1, keepdims=True))
    assert stats.mean_kl == pytest.approx((np.exp(lp) * (lp - lq)).sum(-1).mean(), rel=1e-5)
    top = ref.argmax(-1)
    assert stats.top1_agreement == pytest.approx((got.argmax(-1) == top).mean())
    assert stats.max_dlogprob == pytest.approx(np.abs(lq[range(6), top] - lp[range(6), top]).max(), rel=1e-5)
    broken = QuantStats()
    got[2, 7] = np.nan
    broken.add(got, ref)
    assert broken.nonfinite == 1 and not broken.passed and "non-finite" in broken.failures()[0]
