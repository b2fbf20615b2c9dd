"""The error a user sees from a failed `trtopt build` (shared by the FP8 KV option tests)."""

from __future__ import annotations

from typer.testing import CliRunner


def one_line_error(args: list[str], plan, *, after_progress: bool = False) -> str:
    """The error line of a failed `trtopt build`: the only line, or (``after_progress``: a check of the fused graph)
    the last one, after the progress lines of the steps that ran. The plan dir is not created."""
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", *args, "-o", str(plan)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == lines[-1:] and (after_progress or len(lines) == 1), result.output
    assert not plan.exists()
    return lines[-1]
