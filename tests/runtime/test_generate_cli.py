"""`trtopt generate` (trtopt/cli/generate.py) on the tiny-llama plan. Lives here to share the plan fixtures."""

from typer.testing import CliRunner

from trtopt.cli.main import app

runner = CliRunner()


def test_generate_streams_a_greedy_completion(built_plan, engine_for):
    plan = str(built_plan("tiny-llama"))
    # --eager is a no-op on the CPU (no CUDA graphs there) and must be accepted.
    result = runner.invoke(app, ["generate", plan, "-p", "Hello there", "--max-tokens", "8", "--eager"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    engine = engine_for("tiny-llama", "torch")
    from trtopt.runtime.sampling_params import SamplingParams

    engine.add_request("x", "Hello there", SamplingParams(temperature=0, max_tokens=8))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    assert text.strip() and text.strip() in result.output.replace("\n", "")
    assert "greedy, max_tokens=8" in result.output


def test_generate_batch_chat_and_bad_values(built_plan):
    plan = str(built_plan("tiny-llama"))
    result = runner.invoke(app, ["generate", plan, "-p", "Hi", "-p", "Bye", "--chat", "--max-tokens", "3", "--n", "2",
                                 "--temperature", "0.8", "--seed", "1", "--backend", "onnxruntime"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.count("(length)") == 4
    bad = runner.invoke(app, ["generate", plan, "-p", "Hi", "--top-p", "0"])
    assert bad.exit_code == 1 and "SamplingParams.top_p" in bad.output and "Traceback" not in bad.output


def test_generate_help_has_examples():
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--chat --prompt" in result.output and "--eager" in result.output
