"""Server processes and small client helpers shared by the serve tests (fixtures live in conftest.py)."""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from pagelm.bench.server import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGELM = ROOT / ".venv" / "bin" / "pagelm"
STARTUP_S = 600  # a server that exits early fails at once; a slow, loaded machine may need minutes
REQUEST_S = 300
API_KEY = "test-key-123"
# One compute thread per server: on a small machine shared with other busy processes, torch's and
# numba's default thread pools oversubscribe the cores and generation slows down by 10x or more.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ServerProcess:
    """One `pagelm serve` subprocess; `url` once /health answered 200."""

    def __init__(self, model: str, *args: str, env: dict | None = None, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = [str(PAGELM), "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            self.args += ["--api-key", api_key]
        self.stderr = tempfile.NamedTemporaryFile(prefix="pagelm-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self.stderr, stderr=self.stderr,
                                     env={**os.environ, **THREADS_ENV, **(env or {})}, start_new_session=True)
        self._ready = False

    def log(self) -> str:
        return Path(self.stderr.name).read_text(errors="replace")

    def wait_ready(self) -> ServerProcess:
        if self._ready:
            return self
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        print(f"pagelm serve failed to start: {' '.join(self.args)}\n{log}", file=sys.stderr)
        pytest.fail(f"server did not become ready (exit code {self.proc.returncode}):\n{log}")

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.stderr.close()
        try:
            os.unlink(self.stderr.name)
        except OSError:
            pass

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=REQUEST_S, headers=self.headers, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", timeout=REQUEST_S,
                             max_retries=0)

    @property
    def model(self) -> str:
        return httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30).json()["data"][0]["id"]

    def ps(self) -> dict:
        r = httpx.get(f"{self.url}/api/ps", headers=self.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


class Servers:
    """Starts each configuration once; all are stopped at the end of the session."""

    def __init__(self):
        self.running: dict[str, ServerProcess] = {}

    def get(self, key: str, model: str, *args: str, **kw) -> ServerProcess:
        if key not in self.running:
            self.running[key] = ServerProcess(model, *args, **kw)
        return self.running[key].wait_ready()

    def stop_all(self) -> None:
        for server in self.running.values():
            server.interrupt()  # all shut down at once, then each is waited for (and killed if it hangs)
        for server in self.running.values():
            server.stop()


# -- helpers -------------------------------------------------------------------------------

def ndjson(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line.strip()]


def sse(response) -> tuple[list[dict], bool]:
    """(data objects, whether the stream ended with [DONE]) from a response or an iterator of its lines."""
    chunks, done = [], False
    for line in response.iter_lines() if isinstance(response, httpx.Response) else response:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        chunks.append(json.loads(data))
    return chunks, done


# -- images ------------------------------------------------------------------------------

QUESTION = "What is in this picture?"


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def openai_chat(server, *images: bytes, text: str = QUESTION, system: str | None = None) -> dict:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(i)}"}} for i in images]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": parts}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": server.model, "messages": messages, "max_tokens": 8,
                                                 "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})
    return {"status": r.status_code, **r.json()}


def usage(reply: dict) -> tuple[int, int]:
    return reply["usage"]["prompt_tokens"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket, IPv4 and IPv6, from /proc/net."""
    found = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            found[int(fields[9])] = (str(address), int(hex_port, 16))
    return found


def listening_sockets(pids: list[int]) -> list[tuple[str, tuple[str, int]]]:
    """(process name, (address, port)) of each TCP socket these processes listen on."""
    listeners = _tcp_listeners()
    found = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # it ended meanwhile
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listeners:
                found.append((name, listeners[int(link[8:-1])]))
    return found
