"""The chat page of `pagelm serve` (GET /, its files under /ui/): served from the installed package,
gzipped, with ETags, content-hashed URLs and a strict Content-Security-Policy; nothing fetched at run time.

The page itself (index.html, app.js, style.css) talks only to the server's own API; vendor/ holds the
third-party libraries that scripts/fetch_ui_vendor.py fetched from the npm registry, with their licenses.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

HERE = Path(__file__).resolve().parent
PAGE_FILES = (".html", ".js", ".css")
# scripts and styles only from this origin (no inline code), connections only to it, images of the
# conversation as data: URLs; no frames, plugins or form posts elsewhere
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
FOREVER = "public, max-age=31536000, immutable"  # a URL carrying the file's hash never changes


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes
    media_type: str
    digest: str  # of the body: the ETag, and the ?v= of URLs that name this version

    @classmethod
    def of(cls, name: str, body: bytes) -> Asset:
        media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if media_type.startswith("text/") or media_type.endswith("javascript"):
            media_type += "; charset=utf-8"
        return cls(body, gzip.compress(body, 9, mtime=0), media_type, hashlib.sha256(body).hexdigest()[:16])


def _servable(path: Path) -> bool:
    return path.is_file() and "__pycache__" not in path.parts and (
        path.suffix in PAGE_FILES or path.name.startswith("LICENSE") or path.name == "VERSIONS")


def load_assets() -> dict[str, Asset]:
    """Every file of the page by its URL path under /ui/, and "" for index.html with each
    /ui/ reference it makes pinned to that file's digest."""
    assets = {path.relative_to(HERE).as_posix(): Asset.of(path.name, path.read_bytes())
              for path in sorted(HERE.rglob("*")) if _servable(path) and path.name != "index.html"}

    def pinned(match: re.Match) -> str:
        name = match.group(1)
        if name not in assets:
            raise FileNotFoundError(f"index.html refers to /ui/{name}, which is not in {HERE}")
        return f'"/ui/{name}?v={assets[name].digest}"'

    page = re.sub(r'"/ui/([^"?]+)"', pinned, (HERE / "index.html").read_text("utf-8"))
    assets[""] = Asset.of("index.html", page.encode())
    return assets


def _respond(request: Request, asset: Asset, cache: str) -> Response:
    headers = {"ETag": f'"{asset.digest}"', "Cache-Control": cache, "Vary": "Accept-Encoding",
               "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer"}
    if request.headers.get("if-none-match") == headers["ETag"]:
        return Response(status_code=304, headers=headers)
    body = asset.body
    if "gzip" in request.headers.get("accept-encoding", ""):
        body, headers["Content-Encoding"] = asset.gzipped, "gzip"
    return Response(body, media_type=asset.media_type, headers=headers)


def routes() -> list[Route]:
    """GET / (the page, revalidated on every load) and GET /ui/{file} (cached for good when asked
    for by the digest index.html names)."""
    assets = load_assets()

    async def page(request: Request) -> Response:
        return _respond(request, assets[""], "no-cache")

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"]) if request.path_params["name"] else None
        if found is None:
            raise HTTPException(404)
        return _respond(request, found, FOREVER if request.query_params.get("v") == found.digest else "no-cache")

    return [Route("/", page, methods=["GET", "HEAD"]), Route("/ui/{name:path}", asset, methods=["GET", "HEAD"])]
