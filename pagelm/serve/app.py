"""The ASGI application: the route table (health, metrics, each protocol's routes, the chat page),
the model's loading when the server starts, and the answers to unknown routes and crashes.

It only assembles: what a request does lives in `core` and the protocol modules, never here.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pagelm.serve import ollama_api, openai_api, ui
from pagelm.serve.core import Server, ServeSettings, error_response, internal_error
from pagelm.serve.guard import Guard
from pagelm.serve.metrics import prometheus_text
from pagelm.serve.requests import RequestError

log = logging.getLogger("pagelm.serve")


def create_app(settings: ServeSettings, on_load=None, server: Server | None = None) -> Guard:
    """The app behind its guard (serve.guard); the model starts loading when the server starts.
    `on_load(error or None)` is called once loading ends. `server`: one built elsewhere (the
    cluster's ingress), else a Server."""
    server = server or Server(settings)
    if on_load is not None:
        server.on_load = on_load

    async def health(request: Request) -> Response:
        if server.load_error is not None:
            return JSONResponse({"status": "error", "error": str(server.load_error)}, status_code=500)
        if not server.ready:
            compiling = server.compiling.status() if server.compiling is not None else None
            detail = {"detail": compiling} if compiling else {}
            return JSONResponse({"status": "loading", **detail}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok", "model": server.chat.name})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(prometheus_text(await server.current_stats()))

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=server.load, name="pagelm-load", daemon=True).start()
        yield
        if server.worker is not None:
            server.worker.close()

    routes = [Route("/health", health), Route("/metrics", server.endpoint(metrics))]
    routes += openai_api.routes(server) + ollama_api.routes(server)
    if settings.ui:
        routes += ui.routes()

    async def not_found(request: Request, exc) -> Response:
        return error_response(RequestError(f"no route {request.method} {request.url.path}", status=404), request)

    async def wrong_method(request: Request, exc) -> Response:
        return error_response(RequestError(f"{request.method} is not allowed on {request.url.path}", status=405,
                                           headers=getattr(exc, "headers", None)), request)

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(internal_error(), request)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: wrong_method, Exception: crashed})
    return Guard(app, settings.host, settings.allowed_hosts, settings.allowed_origins)
