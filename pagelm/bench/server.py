"""A `pagelm serve` child process for benchmarks: start on a free port, wait for /health, talk
HTTP (plain, SSE and NDJSON streams), read its memory from /proc, stop it.

Owns the process's lifetime and the wire; what to ask the server belongs to the benchmarks.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

from pagelm.errors import PagelmError
from pagelm.measure.memory import MemorySnapshot, read_memory

LOAD_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ServerConfig:
    """One way of serving a model: what `pagelm bench` compares."""

    embedding: str = "mapped"  # mapped | dense
    prefix_cache: bool = True
    ctx_len: int = 4096
    weights: str = "mapped"  # mapped | dense

    @property
    def label(self) -> str:
        return f"embedding {self.embedding}, cache {'on' if self.prefix_cache else 'off'}"

    def flags(self) -> list[str]:
        return ["--embedding", self.embedding, "--weights", self.weights, "--ctx-len", str(self.ctx_len),
                "--prefix-slots", "32" if self.prefix_cache else "0"]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict


@dataclass
class Stream:
    """A streamed response: its headers now, its events (decoded JSON objects) as they arrive."""

    status: int
    headers: dict[str, str]
    events: Iterator[dict]
    connection: http.client.HTTPConnection = field(repr=False)

    def close(self) -> None:
        self.connection.close()


def mmproj_flags(mmproj: str | None) -> list[str]:
    """The `pagelm serve` flags that give a server the vision tower `mmproj` (none for None)."""
    return [] if mmproj is None else ["--mmproj", mmproj]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process(process: subprocess.Popen, ask, timeout: float) -> None:
    """Ask a running process to end (`ask(process)`), then kill it if it has not within `timeout` seconds."""
    if process.poll() is None:
        ask(process)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ServerProcess:
    """`pagelm serve MODEL` as a child process; use as a context manager so it always stops."""

    def __init__(self, model_path: str, config: ServerConfig, extra_flags: list[str] | None = None):
        self.model_path, self.config = model_path, config
        self.port = free_port()
        self._log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, "-m", "pagelm", "serve", model_path, "--port", str(self.port),
                   *config.flags(), *(extra_flags or [])]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log)
        self.load_s = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 15) -> str:
        self._log.seek(0)
        return "".join(self._log.readlines()[-lines:])

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.process.poll() is not None:
                raise PagelmError(f"pagelm serve {self.model_path} ({self.config.label}) exited with status "
                                  f"{self.process.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health").status == 200:
                    self.load_s = time.perf_counter() - start
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise PagelmError(f"pagelm serve {self.model_path} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        end_process(self.process, lambda process: process.send_signal(signal.SIGTERM), 15)
        self._log.close()

    def memory(self) -> MemorySnapshot:
        return read_memory(self.pid)

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)

    def get(self, path: str) -> Reply:
        return self._request("GET", path, None, {})

    def post(self, path: str, body: dict, headers: dict | None = None) -> Reply:
        return self._request("POST", path, body, headers or {})

    def _request(self, method: str, path: str, body: dict | None, headers: dict) -> Reply:
        connection = self._connection()
        try:
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
            response = connection.getresponse()
            raw = response.read()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                         json.loads(raw) if raw else {})
        finally:
            connection.close()

    def stream(self, path: str, body: dict, headers: dict | None = None) -> Stream:
        """POST and stream: server-sent events (`data: {...}` up to `data: [DONE]`) or NDJSON lines."""
        connection = self._connection()
        connection.request("POST", path, body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()

        def events() -> Iterator[dict]:
            try:
                for line in response:
                    line = line.strip()
                    if not line:
                        continue
                    if line.startswith(b"data:"):
                        line = line[5:].strip()
                        if line == b"[DONE]":
                            return
                    yield json.loads(line)
            finally:
                connection.close()

        return Stream(response.status, {k.lower(): v for k, v in response.getheaders()}, events(), connection)

    def stats(self) -> dict:
        """The server's own counters (`GET /api/ps`: prefix_cache, requests, memory)."""
        return self.get("/api/ps").body


def progress(message: str) -> None:
    print(f"pagelm bench: {message}", file=sys.stderr, flush=True)
