"""The serving subcommands: help with examples, and one-line errors for user mistakes."""

from __future__ import annotations

from typer.testing import CliRunner

from trtopt.cli.main import app

runner = CliRunner()


def test_serve_help_shows_examples():
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    assert "Examples" in result.output and "trtopt serve out/plan --port 8000" in result.output
    assert "--api-key" in result.output


def test_triton_repo_help_shows_examples():
    result = runner.invoke(app, ["triton-repo", "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    assert "trtopt triton-repo out/plan -o out/triton-repo" in result.output


def test_triton_repo_bad_kind_is_one_line(tiny_plan, tmp_path):
    result = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path), "--kind", "tpu"])
    assert result.exit_code == 1
    assert "ConfigError" in result.output and "--kind='tpu' must be cpu or gpu" in result.output
    assert not (tmp_path / "trtopt").exists()


def test_triton_repo_refuses_to_overwrite_without_force(tiny_plan, tmp_path):
    assert runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path)]).exit_code == 0
    again = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path)])
    assert again.exit_code == 1 and "--force" in again.output
    assert runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path), "--force"]).exit_code == 0


def test_triton_repo_copy_plan_is_relocatable(tiny_plan, tmp_path):
    result = runner.invoke(app, ["triton-repo", str(tiny_plan), "-o", str(tmp_path), "--name", "m", "--copy-plan",
                                 "--instances", "2", "--kind", "gpu", "--max-batch-tokens", "256"])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "m" / "config.pbtxt").read_text()
    assert 'string_value: "plan"' in config and str(tiny_plan) not in config
    assert "count: 2 kind: KIND_GPU" in config and '"max_num_batched_tokens" value: { string_value: "256" }' in config
    assert (tmp_path / "m" / "1" / "plan" / "plan.json").is_file()


def test_triton_repo_rejects_a_missing_plan(tmp_path):
    result = runner.invoke(app, ["triton-repo", str(tmp_path / "nope"), "-o", str(tmp_path / "repo")])
    assert result.exit_code == 1 and "Traceback" not in result.output
