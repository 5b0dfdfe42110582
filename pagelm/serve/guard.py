"""Who may talk to the server from a browser: the Host a request names and the Origin it comes from.

A server bound to loopback answers only requests naming it by a loopback name (localhost,
127.0.0.1, [::1]) or a name allowed with --allowed-host: a page on a name that an attacker's DNS
points at 127.0.0.1 (DNS rebinding) is refused. A request from a browser page of another origin
is refused unless that origin is loopback or allowed with --allowed-origin ("*": any), and those
allowed get CORS headers; the chat page, served from the server's own origin, always passes.
Clients that are not browsers send no Origin and pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request

from pagelm.serve.core import error_response
from pagelm.serve.requests import RequestError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# origins on loopback (any scheme and port) are as trusted as the user's own machine, as Ollama does
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
CORS_HEADERS = ["Authorization", "Content-Type", "X-Api-Key", "X-Request-Id"]


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches only this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(value: str) -> str:
    """The name of a Host header or an origin's authority, lowercase, without port or brackets."""
    name = urlsplit(f"//{value}").hostname
    return (name or "").rstrip(".")


class Guard:
    """ASGI middleware in front of the app: refuses foreign Host names (on a loopback bind) and
    foreign Origins with a 403 in the protocol's error shape, and answers CORS for allowed origins."""

    def __init__(self, app, bind: str, allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()):
        self.check_host = is_loopback(bind)
        self.hosts = LOOPBACK_NAMES | {host_name(h) for h in allowed_hosts}
        self.origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.app = CORSMiddleware(app, allow_origins=sorted(self.origins), allow_origin_regex=LOOPBACK_ORIGINS,
                                  allow_methods=["GET", "POST"], allow_headers=CORS_HEADERS,
                                  expose_headers=["X-Request-Id"])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(Headers(scope=scope))
            if refusal is not None:
                await error_response(refusal, Request(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers) -> RequestError | None:
        host, origin = headers.get("host"), headers.get("origin")
        if self.check_host and host is not None and host_name(host) not in self.hosts:
            return RequestError(f"Host {host!r} is not a name of this server (it listens on loopback); "
                                f"start it with --allowed-host NAME to allow one", status=403)
        if origin is not None and not self.origin_allowed(origin, host):
            return RequestError(f"requests from origin {origin!r} are not allowed; start the server with "
                                f"--allowed-origin {origin} to allow them", status=403)
        return None

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        parts = urlsplit(origin.lower())
        if "*" in self.origins or origin.rstrip("/").lower() in self.origins:
            return True
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (sandboxed frames, files), extensions' schemes: only when listed
        if host is not None and parts.netloc == host.lower():
            return True  # the server's own pages
        return parts.hostname in LOOPBACK_NAMES
