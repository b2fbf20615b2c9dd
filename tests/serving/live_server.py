"""A live `trtopt serve` subprocess for tests: start it on a free 127.0.0.1 port, read its /metrics."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "tiny"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

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
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"trtopt serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"trtopt serve did not become healthy in 120 s:\n{server.log()}")
