"""Bad input gives one QuantizeError line (no traceback from the CLI); the calibration text rule is fixed."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from trtopt.cli.main import app
from trtopt.errors import QuantizeError, TrtOptError
from trtopt.quantize import QuantizeConfig, quantize_model
from trtopt.quantize import data

runner = CliRunner()


@pytest.mark.parametrize("config, message", [
    (QuantizeConfig(weights="int4", group_size=48), "--group-size 48 does not divide K=64"),
    (QuantizeConfig(weights="int8"), "unknown --weights 'int8'"),
    (QuantizeConfig(weights="int4", activations="fp8"), "--activations fp8 needs --weights fp8"),
    (QuantizeConfig(weights="fp8", method="awq"), "--method awq is for --weights int4"),
    (QuantizeConfig(weights="fp8", activations="fp8", activation_scales="per-block"), "--activation-scales"),
    (QuantizeConfig(weights="int4", group_size=0), "--group-size must be positive"),
])
def test_bad_settings_are_one_line_errors(config, message, tiny_export, tmp_path):
    with pytest.raises(QuantizeError, match=message.replace("(", r"\(")) as e:
        quantize_model(tiny_export, tmp_path / "out", config)
    assert "\n" not in str(e.value) and issubclass(QuantizeError, TrtOptError)


def test_group_size_error_suggests_a_group_that_divides(tiny_export, tmp_path):
    with pytest.raises(QuantizeError, match="use --group-size 32"):
        quantize_model(tiny_export, tmp_path / "out", QuantizeConfig(weights="int4", group_size=48))


def test_bad_files(tiny_export, tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model")
    with pytest.raises(QuantizeError, match="not"):
        quantize_model(text, tmp_path / "a", QuantizeConfig())
    with pytest.raises(QuantizeError, match="does not exist"):
        quantize_model(tmp_path / "missing", tmp_path / "b", QuantizeConfig())
    once = quantize_model(tiny_export, tmp_path / "q", QuantizeConfig(weights="fp8"))
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_model(once.out_dir, tmp_path / "c", QuantizeConfig())
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_model(tiny_export, once.out_dir, QuantizeConfig())
    with pytest.raises(QuantizeError, match="no MatMul"):
        quantize_model(tiny_export, tmp_path / "d", QuantizeConfig(exclude=("*",)))


def test_cli_prints_one_line_and_no_traceback(tiny_export, tmp_path):
    result = runner.invoke(app, ["quantize", str(tiny_export), "-o", str(tmp_path / "o"), "--weights", "int4",
                                 "--group-size", "48"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "QuantizeError: --group-size 48" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_help_has_examples():
    result = runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0 and "Examples" in result.output and "--activation-scales dynamic" in result.output


def test_cli_quantizes(tiny_export, tmp_path):
    result = runner.invoke(app, ["quantize", str(tiny_export), "-o", str(tmp_path / "o"), "--weights", "int4",
                                 "--group-size", "32", "--exclude", "node_linear_1*"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "quantized 9 MatMul(s) to INT4 sym int4 g32 RTN" in result.output  # node_linear, _2.._9
    assert (tmp_path / "o" / "model.onnx").is_file()


def test_text_rule_is_fixed_and_disjoint():
    tokens = np.arange(10_000)
    slices = data.split_windows(tokens, calibration=(4, 512), heldout=(8, 512))
    assert slices.calibration.shape == (4, 512) and slices.heldout.shape == (8, 512)
    assert slices.calibration[0, 0] == 0 and slices.heldout[-1, -1] == 9_999
    assert slices.calibration.max() < slices.heldout.min()
    with pytest.raises(Exception, match="need 10240 tokens"):
        data.split_windows(tokens, calibration=(4, 512), heldout=(16, 512))
    text = data.corpus_text()
    assert text == data.corpus_text() and len(text) > 400_000 and text.startswith(text[:50])
