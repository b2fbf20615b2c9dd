"""Graceful shutdown of `trtopt serve`: SIGTERM with streams in flight aborts them and the process exits within
the documented bound (--shutdown-timeout, 5 s by default)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
from live_server import API_KEY, MODEL, start_server

SHUTDOWN_BOUND_S = 5.0
SLACK_S = 1.0  # process teardown on a loaded 2-core CI machine


def _stream(base_url: str, events: list, first: threading.Event) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as e:  # the server may close the connection instead of ending the stream
        events.append(f"closed: {type(e).__name__}")
    first.set()


def test_sigterm_with_streams_in_flight_exits_in_bound(tiny_plan, tmp_path):
    # A small step budget makes 8 x 500-token streams take far longer than the bound (~0.5-1 ms per token alone).
    srv = start_server(tiny_plan, tmp_path / "serve.log", "--api-key", API_KEY, "--max-num-seqs", "8",
                       "--num-blocks", "160", "--log-level", "info")
    try:
        streams = [([], threading.Event()) for _ in range(8)]
        threads = [threading.Thread(target=_stream, args=(srv.base_url, ev, first), daemon=True) for ev, first in streams]
        for t in threads:
            t.start()
        for _, first in streams:
            assert first.wait(30), "no stream started"
        srv.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            code = srv.process.wait(SHUTDOWN_BOUND_S + SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trtopt serve still running {SHUTDOWN_BOUND_S + SLACK_S} s after SIGTERM:\n{srv.log()[-3000:]}")
        elapsed = time.monotonic() - start
        print(f"exited {elapsed:.2f} s after SIGTERM with code {code}")
        for t in threads:
            t.join(10)
        # Every stream ended: with an in-band error event and [DONE], or a closed connection; none ran to the end.
        for events, _ in streams:
            tokens = sum(1 for e in events if e.startswith("{") and "choices" in json.loads(e))
            assert tokens < 500, "a stream ran to completion: SIGTERM did not abort it"
            assert events[-1] == "[DONE]" or events[-1].startswith("closed"), events[-3:]
        assert code in (0, -signal.SIGTERM), srv.log()[-3000:]  # uvicorn re-raises the signal it handled
    finally:
        if srv.process.poll() is None:
            srv.process.kill()


def _disconnected(srv) -> float:
    return srv.metrics().get('trtopt_requests_total{endpoint="completions",outcome="disconnected"}', 0.0)


def test_non_streaming_client_that_leaves_is_aborted_while_queued(tiny_plan, tmp_path):
    """A non-streaming request that waits behind others produces no output for a long time; its client giving up
    must still abort it at once (it used to be noticed only when an output arrived, i.e. after the queue ahead)."""
    srv = start_server(tiny_plan, tmp_path / "serve.log", "--api-key", API_KEY, "--max-num-seqs", "1")
    try:
        streams = [([], threading.Event()) for _ in range(4)]  # ~2000 tokens of work, one sequence at a time
        threads = [threading.Thread(target=_stream, args=(srv.base_url, ev, first), daemon=True) for ev, first in streams]
        for t in threads:
            t.start()
        assert streams[0][1].wait(30), "no stream started"
        body = {"model": MODEL, "prompt": "queued", "max_tokens": 4, "ignore_eos": True}
        try:
            httpx.post(f"{srv.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=httpx.Timeout(30, read=0.5))
            raise AssertionError("the queued request should not have been answered within 0.5 s")
        except httpx.ReadTimeout:
            left = time.monotonic()
        while _disconnected(srv) < 1:
            assert time.monotonic() - left < 2.0, "the abandoned request was not aborted within 2 s"
            time.sleep(0.05)
        noticed = time.monotonic() - left
        still_running = srv.metrics()["trtopt_num_requests_running"]
        print(f"abandoned queued request aborted {noticed:.2f} s after the client left")
        assert still_running >= 1, "the streams ahead had all finished: the test proved nothing"
    finally:
        srv.process.kill()
        srv.process.wait(10)
