"""The offline batch runner (vLLM's `run-batch`): an OpenAI Batch API file in, one result line per request out.

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}.
Output lines, in input order (vLLM's BatchRequestOutput): {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}; a good request has its response body and error null, a refused one its HTTP status,
body null and the server's error object ({"error": {"message", "type", "param", "code"}}) as error, and a line the
runner cannot send (not JSON, no custom_id, an unknown url, stream: true) status 400 and a message string as error.

Each request goes through the server's own app in process (httpx's ASGI transport, no socket): validation, the
model check, prompt preparation, rendering and error bodies have one owner, trtopt.serving.server, and all requests
are in flight at once on its one engine, so they are batched continuously (docs/architecture.md §6). A bad line
never stops the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from pathlib import Path
from typing import IO, Any, Callable

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, ValidationError

from trtopt.errors import ConfigError
from trtopt.serving.protocol import ChatCompletionRequest, CompletionRequest

# The URLs a batch line may POST to, and the body class the route parses (read here only for `stream`).
BATCH_ROUTES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One non-blank input line, parsed. problem: why it cannot be sent (None: send body to url)."""

    index: int  # place among the non-blank lines: the output line it answers
    line_no: int  # 1-based line number in the file, for messages
    custom_id: str | None  # None only for a malformed line that has no string custom_id
    url: str | None
    body: dict[str, Any] | None
    problem: str | None = None
    malformed: bool = False  # not a batch request at all (vLLM refuses the whole file for such a line)


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """The output line of one BatchLine."""

    index: int
    custom_id: str | None
    status_code: int
    body: dict[str, Any] | None  # the response body (status 200), else None
    error: dict[str, Any] | str | None  # the server's error object, or the runner's message; None on success

    def to_json(self) -> dict[str, Any]:
        """vLLM's BatchRequestOutput (ids as vLLM makes them, with trtopt's prefix)."""
        return {"id": f"trtopt-{uuid.uuid4().hex}", "custom_id": self.custom_id,
                "response": {"status_code": self.status_code, "request_id": f"trtopt-batch-{uuid.uuid4().hex}",
                             "body": self.body},
                "error": self.error}


@dataclasses.dataclass(frozen=True)
class BatchSummary:
    total: int  # output lines written (one per non-blank input line)
    succeeded: int  # status 200
    malformed_line_nos: tuple[int, ...]  # input lines that were no batch request (their results are errors)

    @property
    def failed(self) -> int:
        return self.total - self.succeeded


def parse_line(text: str, *, index: int, line_no: int) -> BatchLine:
    """A line of the input file -> a BatchLine; a line that cannot be sent carries its problem, never raises."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        return BatchLine(index, line_no, None, None, None, f"line {line_no} is not valid JSON: {e}", malformed=True)
    if not isinstance(obj, dict):
        return BatchLine(index, line_no, None, None, None, f"line {line_no} is not a JSON object.", malformed=True)
    custom_id = obj.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    url, method, body = obj.get("url"), obj.get("method"), obj.get("body")
    shape = {"custom_id": custom_id is not None, "method": isinstance(method, str), "url": isinstance(url, str),
             "body": isinstance(body, dict)}
    missing = [name for name, ok in shape.items() if not ok]
    if missing:
        return BatchLine(index, line_no, custom_id, None, None,
                         f"line {line_no} is not a batch request: {', '.join(missing)} missing or of the wrong type "
                         "(each line is {\"custom_id\": str, \"method\": \"POST\", \"url\": str, \"body\": {...}}).",
                         malformed=True)
    if url not in BATCH_ROUTES:  # vLLM's message, with trtopt's endpoints
        return BatchLine(index, line_no, custom_id, url, body,
                         f"URL {url} was used. Supported endpoints: {', '.join(BATCH_ROUTES)}.")
    if method.upper() != "POST":
        return BatchLine(index, line_no, custom_id, url, body,
                         f"method {method} was used; batch requests are POST.")
    try:
        streamed = BATCH_ROUTES[url].model_validate_json(json.dumps(body)).stream  # as FastAPI parses it
    except ValidationError:
        streamed = False  # the route answers with its own 400, naming the field
    if streamed:
        return BatchLine(index, line_no, custom_id, url, body, "Request must not be sent in stream mode")  # vLLM's
    return BatchLine(index, line_no, custom_id, url, body)


def read_lines(path: str) -> list[BatchLine]:
    """The non-blank lines of a local input file (vLLM skips blank ones too). URLs are refused: nothing is
    downloaded."""
    local = local_path(path, "input")
    if not local.is_file():
        raise ConfigError(f"the input file {path} does not exist; pass a local JSONL file (-i requests.jsonl).")
    texts = local.read_text(encoding="utf-8").splitlines()
    numbered = [(no, t.strip()) for no, t in enumerate(texts, start=1) if t.strip()]
    return [parse_line(t, index=k, line_no=no) for k, (no, t) in enumerate(numbered)]


def local_path(path: str, what: str) -> Path:
    """`path` as a local Path; an http(s) URL (which vLLM downloads or uploads) is a ConfigError."""
    if path.lower().startswith(("http://", "https://")):
        hint = "download it first (curl -o requests.jsonl URL)" if what == "input" else "upload the file afterwards"
        raise ConfigError(f"the {what} file {path} is a URL; trtopt run-batch reads and writes local files only: "
                          f"{hint}.")
    return Path(path)


async def _send(client: httpx.AsyncClient, line: BatchLine) -> BatchResult:
    if line.problem is not None:
        return BatchResult(line.index, line.custom_id, 400, None, line.problem)
    try:
        response = await client.post(line.url, content=json.dumps(line.body),
                                     headers={"content-type": "application/json"})
        payload = response.json()
    except Exception as e:  # vLLM's rule: anything else that goes wrong is this line's error, not the batch's
        return BatchResult(line.index, line.custom_id, 400, None, f"{type(e).__name__}: {e}")
    if response.status_code == 200:
        return BatchResult(line.index, line.custom_id, 200, payload, None)
    return BatchResult(line.index, line.custom_id, response.status_code, None, payload)


async def run_batch(app: FastAPI, lines: list[BatchLine], out: IO[str], *,
                    on_result: Callable[[BatchResult], None] = lambda r: None) -> BatchSummary:
    """Send every line to `app` at once and write one JSON line per input line to `out`, in input order, each
    as soon as every earlier one is written. Runs the app's lifespan (its engine loop starts and stops here)."""
    ready: dict[int, BatchResult] = {}
    next_index = 0
    succeeded = 0

    def write_ready(result: BatchResult) -> None:
        nonlocal next_index, succeeded
        on_result(result)
        succeeded += result.status_code == 200
        ready[result.index] = result
        while next_index in ready:
            out.write(json.dumps(ready.pop(next_index).to_json(), ensure_ascii=False) + "\n")
            next_index += 1

    async def one(client: httpx.AsyncClient, line: BatchLine) -> None:
        write_ready(await _send(client, line))

    # raise_app_exceptions=False: an unexpected error is the app's own 500 body, like over HTTP.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            await asyncio.gather(*(one(client, line) for line in lines))
    assert next_index == len(lines), "every line was answered and written"
    return BatchSummary(len(lines), succeeded, tuple(line.line_no for line in lines if line.malformed))


def run_batch_file(app: FastAPI, lines: list[BatchLine], output_path: str, *,
                   on_result: Callable[[BatchResult], None] = lambda r: None) -> BatchSummary:
    """Run `lines` (read_lines) on `app` (run_batch) and write the local file `output_path`."""
    out_path = local_path(output_path, "output")
    if not out_path.parent.is_dir():
        raise ConfigError(f"the output file's folder {out_path.parent} does not exist; create it first.")
    with out_path.open("w", encoding="utf-8") as out:
        return asyncio.run(run_batch(app, lines, out, on_result=on_result))
