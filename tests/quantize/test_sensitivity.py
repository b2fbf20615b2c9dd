"""`trtopt quantize --exclude auto:N`: every decoder layer is quantized alone and measured against the float model
(mean KL of the logits on calibration text); the N that move the logits most stay high precision. A layer made hard
to quantize for real (an outlier weight in every INT4 group, on an input channel that is always zero) ranks first
and is the one kept float."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from trtopt.cli.main import app
from trtopt.errors import QuantizeError
from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize.api import METADATA_KEY, parse_exclude
from trtopt.quantize.graph import find_targets
from trtopt.quantize.sensitivity import group_by_layer, module_paths

CALIBRATION = ["--calibration-sequences", "2", "--calibration-length", "64"]
HARD_LAYER, GROUP = "1", 32


@pytest.fixture(scope="module")
def hard_layer_export(tiny_export, module_tmp):
    """tiny-llama whose layer-1 norms zero input channels 0, 32, ... (a copy of the shared norm weight), and whose
    layer-1 MatMuls reading those norms get a weight 30x their largest in exactly those rows: the float model is
    unchanged by them (they multiply zeros), but RTN's scale of every INT4 group follows the outlier, so the rest of
    each group rounds to zero. Layer 0, untouched, is the more sensitive layer otherwise."""
    out = module_tmp / "hard"
    shutil.copytree(tiny_export, out)
    model = onnx.load(str(out / "model.onnx"))
    paths = module_paths(model)
    nodes = {n.name: n for n in model.graph.node}
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    for name in group_by_layer(paths, [t.node for t in find_targets(model).quantize])[HARD_LAYER]:
        norm = producers[nodes[name].input[0]]
        slot = next((i for i, x in enumerate(norm.input) if x in inits), None)
        if norm.op_type != "Mul" or slot is None:
            continue  # o_proj and down_proj read no norm
        if not norm.input[slot].startswith("hard_"):
            gamma = numpy_helper.to_array(inits[norm.input[slot]]).copy()
            gamma[::GROUP] = 0
            norm.input[slot] = f"hard_{norm.name}"
            model.graph.initializer.append(numpy_helper.from_array(gamma, norm.input[slot]))
        tensor = inits[nodes[name].input[1]]
        w = numpy_helper.to_array(tensor).copy()  # [K, N]
        w[::GROUP] = 30 * np.abs(w).max()
        tensor.CopyFrom(numpy_helper.from_array(w, tensor.name))
    onnx.save(model, str(out / "model.onnx"))
    return out


def quantize(*args: str):
    return CliRunner().invoke(app, ["quantize", *map(str, args)], env={"COLUMNS": "160"})


def test_exclude_auto_keeps_the_layer_ranked_first_high_precision(hard_layer_export, tmp_path):
    q_proj_0 = next(n for n, p in module_paths(onnx.load(str(hard_layer_export / "model.onnx"),
                                                          load_external_data=False)).items()
                    if p.endswith("layers.0.self_attn.q_proj"))
    result = quantize(hard_layer_export, "-o", tmp_path / "q", "--weights", "int4", "--group-size", str(GROUP),
                      "--exclude", "auto:1", "--exclude", q_proj_0, *CALIBRATION)
    assert result.exit_code == 0, result.output
    assert "layer sensitivity on calibration text" in result.output
    assert "kept high precision by --exclude auto:1" in result.output and f"layer {HARD_LAYER} (7 MatMuls" in result.output
    model = onnx.load(str(tmp_path / "q" / "model.onnx"), load_external_data=False)
    recipe = json.loads({p.key: p.value for p in model.metadata_props}[METADATA_KEY])
    ranking = recipe["sensitivity"]["layers"]
    assert [row["layer"] for row in ranking] == [HARD_LAYER, "0"]
    assert len(ranking[1]["nodes"]) == 6  # layer 0 less its --exclude'd q_proj
    assert ranking[0]["mean_kl"] > 2 * ranking[1]["mean_kl"]
    kept = recipe["kept_float"]
    assert kept[q_proj_0] == f"--exclude {q_proj_0}"
    assert all(kept[n].startswith(f"--exclude auto:1: layer {HARD_LAYER} ranks #1") for n in ranking[0]["nodes"])
    # The kept layer's MatMuls read their float weights; layer 0's others read a weight DequantizeLinear.
    producers = {o: n for n in model.graph.node for o in n.output}
    matmuls = {n.name: n for n in model.graph.node if n.op_type == "MatMul"}
    assert all(matmuls[n].input[1] not in producers for n in ranking[0]["nodes"] + [q_proj_0])
    assert all(producers[matmuls[n].input[1]].op_type == "DequantizeLinear" for n in ranking[1]["nodes"])
    assert recipe["config"]["auto_exclude"] == 1 and recipe["config"]["exclude"] == [q_proj_0]


def test_auto_exclusion_lowers_the_error_of_the_result(hard_layer_export, tmp_path):
    common = dict(weights="int4", group_size=GROUP, calibration_sequences=2, calibration_length=64)
    result = quantize_model(hard_layer_export, tmp_path / "q", QuantizeConfig(auto_exclude=1, **common))
    report = result.sensitivity
    assert len(report.layers) == 2 and report.layers[0].layer == HARD_LAYER
    assert set(report.layers[0].nodes).isdisjoint(result.quantized) and len(result.quantized) == 7
    assert report.layers[0].stats.mean_kl > 2 * report.layers[1].stats.mean_kl
    assert report.full.mean_kl > report.layers[0].stats.mean_kl  # both layers quantized add up


@pytest.mark.parametrize("value", ["auto:0", "auto:-1", "auto:x", "auto:1.5"])
def test_a_bad_n_is_a_one_line_error(value, tiny_export, tmp_path):
    with pytest.raises(QuantizeError, match="N must be a positive integer"):
        parse_exclude([value])
    result = quantize(tiny_export, "-o", tmp_path / "q", "--exclude", value)
    assert result.exit_code == 1 and "N must be a positive integer" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()


def test_parse_exclude_and_too_many_layers(tiny_export, tmp_path):
    assert parse_exclude(["auto", "*mlp*"]) == (("*mlp*",), 2)
    assert parse_exclude(["auto:3"]) == ((), 3)
    assert parse_exclude(["automatic*"]) == (("automatic*",), 0)
    with pytest.raises(QuantizeError, match="would keep all 2 quantized layers high precision; pass N < 2"):
        quantize_model(tiny_export, tmp_path / "q", QuantizeConfig(auto_exclude=2))
