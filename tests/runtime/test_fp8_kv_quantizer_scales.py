"""FP8 KV scales from the quantizer (issue 33: "scales come from `trtopt quantize` calibration when present"):
`trtopt quantize --kv-cache fp8` records each layer's K and V scale, the amax over the calibration windows of the
K/V the float model caches (its present outputs) / 448, in the quantized model's metadata; `trtopt build
--kv-cache-dtype fp8` takes them by default (plan.json `kv_cache_scales: quantizer`, the PagedAttention nodes'
scales, fusion_report.json), keeps 1.0 with a note when smoothing or rotation would change those K/V, and refuses
`--kv-cache-scales quantizer` where it cannot apply. Greedy decoding of the built plan on the torch executor equals
the ONNX body on onnxruntime."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from trtopt.builder.plan import Limits, read_plan
from trtopt.errors import ConfigError
from trtopt.runtime.config import EngineConfig, load_tokenizer
from trtopt.runtime.sampling_params import SamplingParams

from build_errors import one_line_error
from stepping import assert_idle, run_all

MODEL = "tiny-llama"
LIMITS = Limits(block_size=16, max_num_tokens=128, max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def quantized(export_dir, module_tmp):
    from trtopt.quantize import QuantizeConfig, quantize_model

    config = QuantizeConfig(weights="fp8", method="rtn", kv_cache="fp8", calibration_sequences=2,
                            calibration_length=64)
    return quantize_model(export_dir(MODEL), module_tmp / "q", config, force=True)


def _node_scales(plan_dir) -> tuple[list[float], list[float]]:
    graph = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False).graph
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node
             if n.op_type == "PagedAttention"]
    return [a["k_scale"] for a in attrs], [a["v_scale"] for a in attrs]


def test_the_quantizer_records_each_layers_cached_kv_amax_over_448(quantized, export_dir):
    from trtopt.quantize.api import _calibration_sequences, kv_cache_scales
    from trtopt.quantize.graph import resolve_model_path
    from trtopt.quantize.runner import OrtCausalLM

    source = resolve_model_path(export_dir(MODEL))
    lm = OrtCausalLM(source)
    presents = sorted(lm.present_of.values())
    amax = dict.fromkeys(presents, 0.0)
    for seq in _calibration_sequences(source, quantized.config):  # the same windows, each from an empty cache
        out = lm.run(seq.tolist(), outputs=presents)
        amax = {name: max(amax[name], float(np.abs(out[name]).max())) for name in presents}
    layers = len(presents) // 2
    for kv, key in (("key", "k"), ("value", "v")):
        want = [amax[f"present.{i}.{kv}"] for i in range(layers)]
        assert quantized.kv_cache[f"{key}_amax"] == want
        assert quantized.kv_cache[f"{key}_scales"] == [a / 448 for a in want]
    model = onnx.load(str(quantized.model_path), load_external_data=False)
    recorded = kv_cache_scales({p.key: p.value for p in model.metadata_props})
    assert recorded == (quantized.kv_cache["k_scales"], quantized.kv_cache["v_scales"])
    assert quantized.calibration_tokens == 2 * 64 and "FP8 KV scales" in quantized.config.describe()


def test_build_takes_the_quantizers_scales_by_default(quantized, tmp_path):
    from trtopt.builder.pipeline import build_plan
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors import create_executor

    built = build_plan(quantized.out_dir, tmp_path / "plan", limits=LIMITS, force=True, progress=False,
                       kv_cache_dtype="fp8")
    plan = read_plan(built.plan_dir)
    assert plan.kv_cache_scales == "quantizer"
    assert json.loads((built.plan_dir / "plan.json").read_text())["kv_cache_scales"] == "quantizer"
    k, v = _node_scales(built.plan_dir)
    np.testing.assert_allclose(k, quantized.kv_cache["k_scales"], rtol=1e-6)  # float32 attributes
    np.testing.assert_allclose(v, quantized.kv_cache["v_scales"], rtol=1e-6)
    report = json.loads((built.plan_dir / "fusion_report.json").read_text())["kv_scales"]
    assert report == {"source": "trtopt quantize --kv-cache fp8", "k": quantized.kv_cache["k_scales"],
                      "v": quantized.kv_cache["v_scales"]}
    assert "from the source's quantizer" in built.kv_scales

    def greedy(backend: str) -> list[list[int]]:
        engine = LLMEngine(create_executor(backend, built.plan_dir, plan), plan, load_tokenizer(built.plan_dir),
                           EngineConfig(max_model_len=128))
        for i, prompt in enumerate(["Hello, my name is", "The capital of France"]):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        done = run_all(engine)
        assert_idle(engine)
        return [done[str(i)].outputs[0].token_ids for i in range(2)]

    tokens = greedy("torch")
    assert tokens == greedy("onnxruntime") and all(len(t) == 12 for t in tokens)


def test_smoothing_keeps_scales_of_one_with_a_note_and_one_is_still_a_choice(quantized, tmp_path):
    from trtopt.builder.pipeline import build_plan
    from trtopt.runtime.kv_calibration import kv_stats

    smoothed = build_plan(quantized.out_dir, tmp_path / "smoothed", limits=LIMITS, force=True, progress=False,
                          kv_cache_dtype="fp8", kv_cache_smoothing="k", kv_calibrator=kv_stats)
    assert smoothed.config.kv_cache_scales == "one" and _node_scales(smoothed.plan_dir) == ([1.0] * 2, [1.0] * 2)
    assert any("--kv-cache-smoothing changes them" in note for note in smoothed.notes), smoothed.notes
    ones = build_plan(quantized.out_dir, tmp_path / "one", limits=LIMITS, force=True, progress=False,
                      kv_cache_dtype="fp8", kv_cache_scales="one")
    assert ones.config.kv_cache_scales == "one" and not ones.notes
    plain = build_plan(quantized.out_dir, tmp_path / "bf16", limits=LIMITS, force=True, progress=False)
    assert plain.config.kv_cache_dtype == "auto" and plain.config.kv_cache_scales == "one"


def test_quantizer_scales_where_they_cannot_apply_are_one_line_errors(quantized, export_dir, tmp_path):
    line = one_line_error([str(export_dir(MODEL)), "--kv-cache-dtype", "fp8", "--kv-cache-scales", "quantizer"],
                          tmp_path / "a")
    assert "has no FP8 KV scales" in line and "trtopt quantize --kv-cache fp8" in line
    line = one_line_error([str(quantized.out_dir), "--kv-cache-dtype", "fp8", "--kv-cache-scales", "quantizer",
                           "--kv-cache-rotation", "hadamard"], tmp_path / "b")
    assert "--kv-cache-rotation changes them" in line and "--kv-cache-scales amax" in line
    line = one_line_error([str(quantized.out_dir), "--kv-cache-scales", "quantizer"], tmp_path / "c")
    assert "--kv-cache-dtype fp8" in line


def test_the_quantize_cli_reports_the_scales(export_dir, tmp_path):
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["quantize", str(export_dir(MODEL)), "-o", str(tmp_path / "q"), "--weights",
                                      "fp8", "--method", "rtn", "--kv-cache", "fp8", "--calibration-sequences", "1",
                                      "--calibration-length", "32"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert re.search(r"FP8 KV cache scales \(amax / 448 per layer.*\): K [\d.e-]+\.\.[\d.e-]+, V", text), text
    bad = CliRunner().invoke(app, ["quantize", str(export_dir(MODEL)), "-o", str(tmp_path / "r"), "--kv-cache",
                                   "int8"])
    assert bad.exit_code != 0 and "unknown --kv-cache 'int8'; choose one of: fp8" in " ".join(bad.output.split())


def test_build_plan_refuses_quantizer_scales_a_source_does_not_have(export_dir, tmp_path):
    from trtopt.builder.pipeline import build_plan

    with pytest.raises(ConfigError, match="has no FP8 KV scales"):
        build_plan(export_dir(MODEL), tmp_path / "plan", limits=LIMITS, progress=False, kv_cache_dtype="fp8",
                   kv_cache_scales="quantizer")
