"""A live `larqlpy serve` on 127.0.0.1 for the tests: started as a subprocess, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*EXE, "serve", str(model), "--port", str(self.port), *args], env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"larqlpy serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError("larqlpy serve did not come up")

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=kw.pop("timeout", 120.0), **kw)

    @contextmanager
    def stream(self, path: str, body: dict) -> Iterator[Iterator[str]]:
        """A streamed response's lines (server-sent events)."""
        with httpx.stream("POST", self.url + path, json=body, timeout=120.0) as r:
            yield r.iter_lines()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> str:
        """SIGTERM (a graceful shutdown); returns what it wrote on stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
