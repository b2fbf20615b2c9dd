"""`trtopt run-batch` (vLLM's run-batch): output line shapes, per-line errors, parity with the server's answers for the
same bodies, continuous batching of the whole file, and the CLI (URL refusal, exit codes) on the tiny plan."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from typer.testing import CliRunner

from scripted import ModelFreeExecutor, scripted_engine

MODEL = "m"
WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 6}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "logprobs": 2}


class PositionExecutor(ModelFreeExecutor):
    """The token after position p is WORDS[(p + 1) % 8] (never EOS: max_tokens ends a reply). Records the sequences
    each step ran."""

    def __init__(self, tokenizer) -> None:
        self.ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS]
        self.rows_per_step: list[int] = []

    def next_ids(self, positions: list[int]) -> list[int]:
        self.rows_per_step.append(len(positions))
        return [self.ids[(p + 1) % len(self.ids)] for p in positions]


def _line(custom_id: str | None, url: str, body: dict) -> str:
    obj = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps({k: v for k, v in obj.items() if v is not None})


INPUT = "\n".join([
    _line("chat-1", "/v1/chat/completions", CHAT),  # line 1
    _line("cmpl-1", "/v1/completions", COMPLETION),  # line 2
    '{"custom_id": "broken", "method": "POST", ',  # line 3: not JSON
    _line("embed-1", "/v1/embeddings", {"model": MODEL, "input": "hi"}),  # line 4: a url trtopt does not serve
    "",  # line 5: blank, skipped (vLLM's rule)
    _line("nomodel-1", "/v1/chat/completions", {**CHAT, "model": "NonExistModel"}),  # line 6: 404
    _line("badtemp-1", "/v1/completions", {**COMPLETION, "temperature": "hot"}),  # line 7: the route's 400
    _line("stream-1", "/v1/chat/completions", {**CHAT, "stream": True}),  # line 8: refused, as vLLM does
    _line(None, "/v1/chat/completions", CHAT),  # line 9: no custom_id
    _line("chat-2", "/v1/chat/completions", {**CHAT, "max_tokens": 3}),  # line 10
]) + "\n"


@pytest.fixture(scope="module")
def engine_and_executor(smol_tokenizer):
    executor = PositionExecutor(smol_tokenizer)
    return scripted_engine(executor, smol_tokenizer, max_model_len=256, max_num_seqs=8, num_blocks=128), executor


def _app(engine):
    from trtopt.serving.server import create_app

    return create_app(engine, MODEL)


def _run(engine, text: str, tmp_path):
    from trtopt.serving.run_batch import read_lines, run_batch

    path = tmp_path / "in.jsonl"
    path.write_text(text)
    out = io.StringIO()
    summary = asyncio.run(run_batch(_app(engine), read_lines(str(path)), out))
    return summary, [json.loads(line) for line in out.getvalue().splitlines()]


def _server_answer(engine, url: str, body: dict) -> tuple[int, dict]:
    from starlette.testclient import TestClient

    with TestClient(_app(engine)) as client:
        response = client.post(url, json=body)
    return response.status_code, response.json()


def _stable(body: dict) -> dict:
    """A response body without what differs between two runs of the same request (its id and clock)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_every_line_gets_one_result_in_input_order(engine_and_executor, tmp_path):
    engine, executor = engine_and_executor
    executor.rows_per_step.clear()
    summary, results = _run(engine, INPUT, tmp_path)
    ids = [r["custom_id"] for r in results]
    assert ids == ["chat-1", "cmpl-1", None, "embed-1", "nomodel-1", "badtemp-1", "stream-1", None, "chat-2"]
    for r in results:  # vLLM's BatchRequestOutput
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert set(r["response"]) == {"status_code", "request_id", "body"}
        assert r["id"].startswith("trtopt-") and r["response"]["request_id"].startswith("trtopt-batch-")
    status = {r["custom_id"]: r["response"]["status_code"] for r in results if r["custom_id"]}
    assert status == {"chat-1": 200, "cmpl-1": 200, "embed-1": 400, "nomodel-1": 404, "badtemp-1": 400,
                      "stream-1": 400, "chat-2": 200}
    assert (summary.total, summary.succeeded, summary.failed) == (9, 3, 6)
    assert summary.malformed_line_nos == (3, 9)  # the CLI exits 1 on these (vLLM refuses such a file)
    assert len({r["id"] for r in results}) == len(results)
    # The good requests share the engine's steps (all three usually; two at least, whatever the thread timing).
    assert max(executor.rows_per_step) >= 2


def test_good_lines_match_the_server(engine_and_executor, tmp_path):
    engine, _ = engine_and_executor
    _, results = _run(engine, INPUT, tmp_path)
    by_id = {r["custom_id"]: r for r in results if r["custom_id"]}
    for custom_id, url, body in [("chat-1", "/v1/chat/completions", CHAT), ("cmpl-1", "/v1/completions", COMPLETION),
                                 ("chat-2", "/v1/chat/completions", {**CHAT, "max_tokens": 3})]:
        status, answer = _server_answer(engine, url, body)
        result = by_id[custom_id]
        assert status == result["response"]["status_code"] == 200
        assert result["error"] is None
        assert _stable(result["response"]["body"]) == _stable(answer)
    assert by_id["chat-1"]["response"]["body"]["choices"][0]["message"]["content"].strip()
    assert by_id["cmpl-1"]["response"]["body"]["choices"][0]["logprobs"] is not None


def test_refused_lines_carry_the_servers_error(engine_and_executor, tmp_path):
    engine, _ = engine_and_executor
    _, results = _run(engine, INPUT, tmp_path)
    by_id = {r["custom_id"]: r for r in results if r["custom_id"]}
    for custom_id, url, body in [("nomodel-1", "/v1/chat/completions", {**CHAT, "model": "NonExistModel"}),
                                 ("badtemp-1", "/v1/completions", {**COMPLETION, "temperature": "hot"})]:
        status, answer = _server_answer(engine, url, body)
        result = by_id[custom_id]
        assert result["response"] == {"status_code": status, "request_id": result["response"]["request_id"],
                                      "body": None}
        assert result["error"] == answer and set(answer["error"]) >= {"message", "type", "param", "code"}
    # The runner's own refusals are message strings (vLLM's make_error_request_output).
    assert by_id["embed-1"]["error"] == ("URL /v1/embeddings was used. Supported endpoints: /v1/chat/completions, "
                                         "/v1/completions.")
    assert by_id["stream-1"]["error"] == "Request must not be sent in stream mode"
    broken = [r for r in results if r["custom_id"] is None]
    assert "line 3 is not valid JSON" in broken[0]["error"]
    assert "line 9 is not a batch request: custom_id missing" in broken[1]["error"]
    assert all(r["response"]["body"] is None and r["response"]["status_code"] == 400 for r in broken)


def test_parse_line_never_raises():
    from trtopt.serving.run_batch import parse_line

    for text in ["[]", "1", '"x"', "{", '{"custom_id": 1, "method": "POST", "url": "/v1/completions", "body": {}}',
                 '{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
                 '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}']:
        assert parse_line(text, index=0, line_no=1).problem is not None


# ---- the CLI on the tiny plan ---------------------------------------------------------------------------------------


def _cli(*args: str):
    from trtopt.cli.main import app

    return CliRunner().invoke(app, ["run-batch", *args])


def test_cli_help_has_an_example():
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["run-batch", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "trtopt run-batch out/plan -i requests.jsonl -o results.jsonl" in result.output


def test_cli_names_a_missing_input_file(tmp_path):
    result = _cli(str(tmp_path), "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1
    assert "nope.jsonl does not exist" in result.output


@pytest.mark.parametrize("which", ["-i", "-o"])
def test_cli_refuses_urls(tmp_path, which):
    (tmp_path / "in.jsonl").write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    paths = {"-i": str(tmp_path / "in.jsonl"), "-o": str(tmp_path / "out.jsonl")}
    paths[which] = "https://example.com/batch.jsonl"
    result = _cli(str(tmp_path / "no-plan-needed"), "-i", paths["-i"], "-o", paths["-o"])
    assert result.exit_code == 1
    assert "is a URL; trtopt run-batch reads and writes local files only" in result.output
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_on_the_tiny_plan(tiny_plan, tmp_path):
    name = tiny_plan.name
    good = [_line("c", "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 4}),
            _line("p", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})]
    (tmp_path / "good.jsonl").write_text("\n".join(good) + "\n")
    result = _cli(str(tiny_plan), "-i", str(tmp_path / "good.jsonl"), "-o", str(tmp_path / "good.out.jsonl"),
                  "--num-blocks", "40")
    assert result.exit_code == 0, result.output
    lines = [json.loads(t) for t in (tmp_path / "good.out.jsonl").read_text().splitlines()]
    assert [(r["custom_id"], r["response"]["status_code"], r["error"]) for r in lines] == [("c", 200, None),
                                                                                          ("p", 200, None)]
    assert lines[0]["response"]["body"]["object"] == "chat.completion"
    assert lines[1]["response"]["body"]["usage"]["completion_tokens"] == 4

    # A line that is no batch request: every result is still written, and the command exits 1 (vLLM's
    # test_completions_invalid_input wants a non-zero exit).
    (tmp_path / "bad.jsonl").write_text(good[1] + '\n{"invalid_field": "x"}\n')
    result = _cli(str(tiny_plan), "-i", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "bad.out.jsonl"),
                  "--num-blocks", "40")
    assert result.exit_code == 1
    assert "input lines that are no batch request: 1 (line 2)" in result.output
    lines = [json.loads(t) for t in (tmp_path / "bad.out.jsonl").read_text().splitlines()]
    assert [r["response"]["status_code"] for r in lines] == [200, 400]

    # vLLM's test_empty_file: an empty input writes an empty output and succeeds.
    (tmp_path / "empty.jsonl").write_text("")
    result = _cli(str(tiny_plan), "-i", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "empty.out.jsonl"),
                  "--num-blocks", "40")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "empty.out.jsonl").read_text() == ""
