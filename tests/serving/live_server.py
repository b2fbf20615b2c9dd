"""A live `trtopt serve` subprocess for tests: start it on a free 127.0.0.1 port, read its /metrics; or an app over an
engine made in the test, served by uvicorn in a thread (`app_in_thread`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "tiny"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float, alive=lambda: True) -> bool:
    """Poll GET /health until it answers 200 (True), `alive()` turns False or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def app_in_thread(engine, model: str = "m", **app_options):
    """create_app(engine, model, **app_options) (api_key, max_body_bytes, options=ServerOptions(...)) served by
    uvicorn on a free 127.0.0.1 port in a daemon thread; yields its base URL once /health answers."""
    import uvicorn

    from trtopt.serving.server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model, **app_options), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    assert wait_healthy(base, 30), "the app did not come up"
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(20)


@dataclasses.dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        """SIGTERM (the server's graceful shutdown), then SIGKILL if it has not exited in 15 s."""
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (plus labelled ones keyed by their full name)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits; return the last sample."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["trtopt_num_requests_running"] == 0 and m["trtopt_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {m}")
            time.sleep(0.1)


def start_server(plan: Path, log_path: Path, *extra: str) -> LiveServer:
    port = free_port()
    cmd = [sys.executable, "-m", "trtopt.cli.main", "serve", str(plan), "--host", "127.0.0.1", "--port", str(port),
           "--model-name", MODEL, *extra]
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log_path)
    if wait_healthy(server.base_url, 120, alive=lambda: proc.poll() is None):
        return server
    if proc.poll() is not None:
        raise AssertionError(f"trtopt serve exited with {proc.returncode}:\n{server.log()}")
    proc.kill()
    raise AssertionError(f"trtopt serve did not become healthy in 120 s:\n{server.log()}")


@contextlib.contextmanager
def running_tritonserver(repo: Path, work: Path, model: str):
    """(http base url, grpc address) of the bundled tritonserver serving `repo`; stopped on exit. Skips only when
    tritonserver itself cannot start here; fails when it started but could not load `model` (our bug)."""
    import pytest

    from trtopt.errors import ConfigError
    from trtopt.serving.tritonserver import prepare_tritonserver

    try:
        install = prepare_tritonserver(work / "server")
    except ConfigError as e:
        pytest.skip(f"tritonserver cannot start: {e}")
    http_port, grpc_port = free_port(), free_port()
    log_path = work / "tritonserver.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(install.command(repo, http_port=http_port, grpc_port=grpc_port), env=install.env,
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        _wait_triton_ready(proc, base, log_path, model)
        yield base, f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_triton_ready(proc: subprocess.Popen, base: str, log_path: Path, model: str) -> None:
    import pytest

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace")
            if f"'{model}'" in log:  # the server ran and tried our model: that is our bug, not the environment's
                pytest.fail(f"tritonserver could not load the generated model:\n{log[-4000:]}")
            print(f"tritonserver exited with {proc.returncode} before loading any model:\n{log[-4000:]}")
            pytest.skip(f"tritonserver cannot start here (exit {proc.returncode}); see the printed log")
        try:
            if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.25)
    proc.kill()
    pytest.fail(f"tritonserver not ready in 180 s:\n{log_path.read_text(errors='replace')[-4000:]}")
