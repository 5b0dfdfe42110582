"""A Hugging Face Hub look-alike on loopback for the Hub tests: the endpoints huggingface_hub and
pagelm use (model info, tree, HEAD/GET resolve with Range), with counted bytes, injected faults and
what a compromised Hub answers (`hostile`).

Repositories are files on disk under commits; what is served is recorded in `sent` and `requests`.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CHUNK = 64 * 1024  # the server sends files in chunks of this size
# the repositories the tests serve (conftest.py fills them)
QWEN = "org/qwen-tiny"  # a tiny-chat Qwen3.5 (real tokenizer) in Q8_0 and Q4_0, with two towers
TINY = "org/tiny"  # small Qwen3.5s (4096-token vocabulary) in two commits: for faults, pins and rm
SPLIT = "org/split"  # one GGUF in two parts
HF_DIR = "org/tiny-hf"  # a safetensors checkpoint, with files a model does not need
PRIVATE = "org/private"  # answers 401 without TOKEN
TOKEN = "hf_loopback_secret"


@dataclass(frozen=True)
class HubFile:
    path: Path
    size: int
    sha256: str
    git_sha1: str
    lfs: bool

    @classmethod
    def of(cls, path: Path) -> "HubFile":
        data = path.read_bytes()
        git = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        lfs = path.suffix in (".gguf", ".safetensors", ".pth")
        return cls(path, len(data), hashlib.sha256(data).hexdigest(), git, lfs)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


@dataclass
class Fault:
    """What goes wrong serving one file: the connection dropped after `drop_at` of it (once),
    `unavailable` GETs answered 503 first, a byte flipped, `delay` seconds before each chunk, or
    the body stalled at `hold_at` of it until `released` is set (a slow server, whatever the
    machine's speed). A hostile server: `overlong` bytes more than the file, in a body of no stated
    length, or a Range request answered from byte `range_from` (saying so in its Content-Range)."""

    drop_at: float | None = None
    unavailable: int = 0
    corrupt: bool = False
    delay: float = 0.0
    hold_at: float | None = None
    released: threading.Event = field(default_factory=threading.Event)
    overlong: int = 0
    range_from: int | None = None


@dataclass(frozen=True)
class Hostile:
    """A compromised Hub's repository: `files` (listed name -> the file whose size and sha256 are
    listed, or `sha256` instead) listed under commit id `commit`, whatever those are. Every download
    of a file of the same final name is answered with its bytes, whatever the URL (a client takes
    `..` out of a URL before sending it)."""

    commit: str
    files: dict[str, Path]
    sha256: str | None = None

    def listed(self) -> dict[str, HubFile]:
        served = {name: HubFile.of(path) for name, path in self.files.items()}
        return {name: replace(f, sha256=self.sha256 or f.sha256) for name, f in served.items()}

    def served(self, url_path: str) -> tuple[str, HubFile] | None:
        """(listed name, file) of what a download of `url_path` gets."""
        return next(((name, HubFile.of(path)) for name, path in self.files.items()
                     if PurePosixPath(name).name == PurePosixPath(url_path).name), None)


@dataclass
class HubServer:
    """repos: repo id -> commit -> repository path -> HubFile; refs: repo id -> branch -> commit."""

    repos: dict[str, dict[str, dict[str, HubFile]]] = field(default_factory=dict)
    refs: dict[str, dict[str, str]] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)  # private repo id -> the token it wants
    faults: dict[tuple[str, str], Fault] = field(default_factory=dict)  # (repo id, path) -> fault
    hostile: dict[str, Hostile] = field(default_factory=dict)  # repo id -> what is answered for it instead
    sent: dict[tuple[str, str], int] = field(default_factory=dict)  # (repo id, path) -> body bytes sent
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, url path, Range)
    busy_listings: int = 0  # model info requests answered 503 before one is answered
    url: str = ""

    def add(self, repo: str, files: dict[str, Path], branch: str | None = "main") -> str:
        """A commit of `files` in `repo` (the branch moved to it unless None); returns its id."""
        served = {name: HubFile.of(path) for name, path in files.items()}
        commit = hashlib.sha1(repr(sorted((n, f.etag) for n, f in served.items())).encode()).hexdigest()
        self.repos.setdefault(repo, {})[commit] = served
        if branch:
            self.refs.setdefault(repo, {})[branch] = commit
        return commit

    def reset_counts(self) -> None:
        self.sent.clear()
        self.requests.clear()

    def fetched(self, repo: str) -> int:
        return sum(n for (r, _), n in self.sent.items() if r == repo)

    # -- the endpoints ------------------------------------------------------------------------

    def _commit(self, request: Request, repo: str, revision: str) -> tuple[str, dict[str, HubFile]] | Response:
        if repo not in self.repos:
            return _error(404, "RepoNotFound", f"Repository {repo} not found")
        wanted = self.tokens.get(repo)
        if wanted and request.headers.get("authorization") != f"Bearer {wanted}":
            return _error(401, "RepoNotFound", "Invalid username or password.")
        commit = self.refs.get(repo, {}).get(revision, revision)
        if commit not in self.repos[repo]:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit, self.repos[repo][commit]

    async def model_info(self, request: Request) -> Response:
        p = request.path_params
        repo = f"{p['org']}/{p['name']}"
        if self.busy_listings:
            self.busy_listings -= 1
            return _error(503, "ServiceUnavailable", "injected: try again later")
        if repo in self.hostile:
            commit, files = self.hostile[repo].commit, self.hostile[repo].listed()
        else:
            found = self._commit(request, repo, p.get("revision", "main"))
            if isinstance(found, Response):
                return found
            commit, files = found
        siblings = [{"rfilename": name, "size": f.size, "blobId": f.git_sha1,
                     **({"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                    for name, f in sorted(files.items())]
        return JSONResponse({"_id": repo, "id": repo, "modelId": repo, "sha": commit, "private": repo in self.tokens,
                             "siblings": siblings, "tags": ["gguf"]})

    async def tree(self, request: Request) -> Response:
        p = request.path_params
        repo = f"{p['org']}/{p['name']}"
        found = self._commit(request, repo, p["revision"])
        if isinstance(found, Response):
            return found
        return JSONResponse([{"type": "file", "oid": f.git_sha1, "size": f.size, "path": name,
                              **({"lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                             for name, f in sorted(found[1].items())])

    async def resolve(self, request: Request) -> Response:
        p = request.path_params
        repo, path = f"{p['org']}/{p['name']}", p["path"]
        if repo in self.hostile:
            return await self.hostile_download(request)
        self.requests.append((request.method, request.url.path, request.headers.get("range")))
        found = self._commit(request, repo, p["revision"])
        if isinstance(found, Response):
            return found
        commit, files = found
        if path not in files:
            return _error(404, "EntryNotFound", f"{path} does not exist on {commit}")
        return self._download(request, repo, path, commit, files[path])

    async def hostile_download(self, request: Request) -> Response:
        """Any URL at all: the file of a hostile repository's listing that has its final name."""
        self.requests.append((request.method, request.url.path, request.headers.get("range")))
        for repo, hostile in self.hostile.items():
            if served := hostile.served(request.url.path):
                return self._download(request, repo, served[0], hostile.commit, served[1])
        return _error(404, "EntryNotFound", f"{request.url.path} does not exist")

    def _download(self, request: Request, repo: str, path: str, commit: str, f: HubFile) -> Response:
        fault = self.faults.get((repo, path), Fault())
        headers = {"X-Repo-Commit": commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
                   **({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)} if f.lfs else {})}
        start, status = 0, 200
        if request.headers.get("range", "").startswith("bytes="):
            start = int(request.headers["range"][6:].split("-")[0])
            start = start if fault.range_from is None else fault.range_from
            status = 206
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        if not fault.overlong:
            headers["Content-Length"] = str(f.size - start)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        if fault.unavailable:
            fault.unavailable -= 1
            return _error(503, "ServiceUnavailable", "injected: try again later")
        return StreamingResponse(self._body(repo, path, f, start), status_code=status, headers=headers)

    async def _body(self, repo: str, path: str, f: HubFile, start: int):
        fault = self.faults.get((repo, path), Fault())
        with open(f.path, "rb") as fh:
            fh.seek(start)
            offset = start
            while block := fh.read(CHUNK) or (offset < f.size + fault.overlong and bytes(CHUNK)):  # then junk
                if fault.drop_at is not None and offset >= fault.drop_at * f.size:
                    fault.drop_at = None  # once
                    raise ConnectionAbortedError("injected: connection dropped mid-file")
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                while fault.hold_at is not None and offset >= fault.hold_at * f.size and not fault.released.is_set():
                    await asyncio.sleep(0.05)
                if fault.corrupt and offset <= f.size // 2 < offset + len(block):
                    i = f.size // 2 - offset
                    block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1:]
                self.sent[(repo, path)] = self.sent.get((repo, path), 0) + len(block)
                offset += len(block)
                yield block
                await asyncio.sleep(0)  # a client gone is noticed here (a send to it returns at once)

    def app(self) -> Starlette:
        base = "/api/models/{org}/{name}"
        return Starlette(routes=[
            Route(base, self.model_info),
            Route(base + "/revision/{revision}", self.model_info),
            Route(base + "/tree/{revision}", self.tree),
            Route("/{org}/{name}/resolve/{revision}/{path:path}", self.resolve, methods=["GET", "HEAD"]),
            Route("/{path:path}", self.hostile_download),
        ])


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status,
                        headers={"X-Error-Code": code, "X-Error-Message": message})


class RunningHub:
    """A HubServer served by uvicorn in a thread on 127.0.0.1 until stop()."""

    def __init__(self, hub: HubServer):
        self.hub = hub
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        hub.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(hub.app(), log_level="critical", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the loopback Hub did not start")
            threading.Event().wait(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.socket.close()
