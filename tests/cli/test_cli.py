import subprocess
import sys

from typer.testing import CliRunner

from trtopt.cli.main import app

runner = CliRunner()


def test_help_shows_examples():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "trtopt export smollm2-135m" in result.output
    assert "export" in result.output


def test_export_help_shows_examples():
    result = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "Examples" in result.output and "--exporter legacy" in result.output


def test_user_error_has_no_traceback(tmp_path):
    """The console script prints one clear line for a TrtOptError and exits non-zero."""
    proc = subprocess.run([sys.executable, "-m", "trtopt.cli.main", "export", str(tmp_path / "missing"), "-o",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "ExportError: model" in proc.stderr and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
