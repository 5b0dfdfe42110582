"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streams by default),
/api/embed, /api/embeddings, /api/tags, /api/ps, /api/show, /api/version and /api/cancel (by request id).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagelm import __version__
from pagelm.chat.model import EFFORTS
from pagelm.chat.tools import ToolCall
from pagelm.serve.core import JsonAnswer, Server, events
from pagelm.serve.requests import (RequestError, boolean, embedding_inputs, integer, messages_from, sampling,
                                   stop_strings, string, tools_from)
from pagelm.serve.worker import Delta, Job, Result

# Ollama option names → the OpenAI-style names `sampling` reads
OPTION_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                "repeat_penalty": "repeat_penalty", "reasoning_budget": "reasoning_budget"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _options(server: Server, body: dict):
    """(sampling params, stop strings, context limit or None) from `options`."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("options must be an object")
    fields = {ours: options.get(theirs) for theirs, ours in OPTION_NAMES.items()}
    num_predict = integer(options, "num_predict", -2, where="options.")
    max_tokens = server.max_tokens(None if num_predict is None or num_predict < 0 else num_predict)
    num_ctx = integer(options, "num_ctx", 1, where="options.")
    return sampling(fields, max_tokens, where="options."), stop_strings(options.get("stop"), "options.stop"), num_ctx


def _think(body: dict) -> bool | str | None:
    think = body.get("think")
    if isinstance(think, str):  # newer Ollama accepts "low" / "medium" / "high": an effort, on
        if think not in EFFORTS:
            raise RequestError("think must be true, false, low, medium or high")
        return think
    return boolean(body, "think")


def _json_answer(value) -> JsonAnswer | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if value is None or value == "":
        return None
    if value == "json":
        return JsonAnswer()
    if isinstance(value, dict):
        return JsonAnswer(value)
    raise RequestError('format must be "json" or a JSON schema object')


def _tool_call(call: ToolCall, index: int) -> dict:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.arguments}}


def _done(result: Result) -> dict:
    return {"done": True, "done_reason": result.finish_reason, "total_duration": _ns(result.total_s),
            "load_duration": 0, "prompt_eval_count": result.prompt_tokens - result.cached_tokens,
            "prompt_eval_duration": _ns(result.prefill_s), "eval_count": result.completion_tokens,
            "eval_duration": _ns(result.decode_s), "prompt_cached_count": result.cached_tokens}


def _details(server: Server) -> dict:
    chat = server.require_ready()
    file_type = chat.model.file.metadata.get("general.file_type")
    return {"format": "gguf", "family": chat.architecture, "families": [chat.architecture],
            "parameter_size": "", "quantization_level": "" if file_type is None else str(file_type)}


async def _ndjson(job: Job, record) -> AsyncIterator[str]:
    try:
        async for event in events(job):
            yield json.dumps(record(event), ensure_ascii=False) + "\n"
    except RequestError as e:
        yield json.dumps({"error": str(e)}) + "\n"


async def _respond(request: Request, job: Job, streamed: bool, record, merge) -> Response:
    """The answer: NDJSON lines of `record(event)` when `streamed`, else one object, `merge(deltas, result)`."""
    if streamed:
        return StreamingResponse(_ndjson(job, record), media_type="application/x-ndjson",
                                 headers={"X-Request-Id": job.id})
    deltas, result = [], None
    async for event in events(job, request):
        if isinstance(event, Delta):
            deltas.append(event)
        else:
            result = event
    return JSONResponse(merge(deltas, result), headers={"X-Request-Id": job.id})


def _check(server: Server, body: dict):
    """The model checked; (the options read, whether to stream: unless `stream` is false)."""
    server.check_model(body.get("model"))
    streamed = boolean(body, "stream")
    return _options(server, body), streamed is not False


async def chat(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    (params, stop, num_ctx), streamed = _check(server, body)
    messages, images = messages_from(body.get("messages"), "ollama")
    plan = await server.plan_chat(messages, _think(body), tools_from(body.get("tools")),
                                  answer=_json_answer(body.get("format")), images=images)
    job = server.start(request, plan.prompt, params, stop, "chat", max_len=num_ctx, grammar=plan.grammar)
    name = server.chat.name
    calls = plan.answer_stream()

    def message(reasoning: str, pieces: list) -> dict:
        m = {"role": "assistant", "content": "".join(p for p in pieces if isinstance(p, str))}
        if reasoning:
            m["thinking"] = reasoning
        found = [p for p in pieces if isinstance(p, ToolCall)]
        if found:
            first = len(calls.calls) - len(found)
            m["tool_calls"] = [_tool_call(c, first + i) for i, c in enumerate(found)]
        return m

    def record(event) -> dict:
        if isinstance(event, Delta):
            return {"model": name, "created_at": _now(), "message": message(event.reasoning,
                                                                            calls.push(event.content)),
                    "done": False}
        return {"model": name, "created_at": _now(), "message": message("", calls.finish()), **_done(event)}

    def merge(deltas: list[Delta], result: Result) -> dict:
        pieces = [p for d in deltas for p in calls.push(d.content)] + calls.finish()
        return {"model": name, "created_at": _now(),
                "message": message("".join(d.reasoning for d in deltas), pieces), **_done(result)}

    return await _respond(request, job, streamed, record, merge)


async def generate(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    (params, stop, num_ctx), streamed = _check(server, body)
    text, system = string(body, "prompt"), string(body, "system")
    if text is None:
        raise RequestError("prompt is required (a string)")
    if text == "" and not body.get("images"):  # how Ollama clients ask for the model to be loaded
        server.require_ready()
        return JSONResponse({"model": server.chat.name, "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    images = body.get("images") or []
    if not isinstance(images, list):
        raise RequestError("images must be a list of base64 strings")
    (user,), images = messages_from([{"role": "user", "content": text, "images": images}], "ollama")
    answer = _json_answer(body.get("format"))
    if boolean(body, "raw"):
        if images:
            raise RequestError("a raw prompt cannot carry images: it has no chat template to place them")
        prompt, grammar = await server.raw_prompt(text), await server.json_grammar(answer)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [user]
        plan = await server.plan_chat(messages, _think(body), answer=answer, images=images)
        # a generate client never sends the answer back: nothing to keep for a next turn
        prompt, grammar = replace(plan.prompt, answered=None), plan.grammar
    job = server.start(request, prompt, params, stop, "gen", max_len=num_ctx, grammar=grammar)
    name = server.chat.name

    def record(event) -> dict:
        if isinstance(event, Delta):
            r = {"model": name, "created_at": _now(), "response": event.content, "done": False}
            if event.reasoning:
                r["thinking"] = event.reasoning
            return r
        return {"model": name, "created_at": _now(), "response": "", **_done(event)}

    def merge(deltas: list[Delta], result: Result) -> dict:
        r = {"model": name, "created_at": _now(), "response": "".join(d.content for d in deltas)}
        reasoning = "".join(d.reasoning for d in deltas)
        if reasoning:
            r["thinking"] = reasoning
        return {**r, **_done(result)}

    return await _respond(request, job, streamed, record, merge)


def _model_entry(server: Server) -> dict:
    chat = server.require_ready()
    stat = chat.path.stat()
    return {"name": chat.name, "model": chat.name,
            "modified_at": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            "size": stat.st_size, "digest": "", "details": _details(server)}


async def tags(server: Server, request: Request) -> Response:
    return JSONResponse({"models": [_model_entry(server)]})


async def ps(server: Server, request: Request) -> Response:
    # the server keeps its one model loaded until it stops: an expiry that never comes, as the last
    # time ISO 8601's four-digit years can say (Ollama's own CLI shows such a far time as "Forever")
    entry = {**_model_entry(server), "size_vram": 0, "expires_at": "9999-12-31T23:59:59Z",
             "context_length": server.settings.ctx_len, "file": str(server.chat.path)}
    return JSONResponse({"models": [entry], **(await server.current_stats())})


async def show(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    server.check_model(body.get("model") or body.get("name"))
    chat = server.chat
    metadata = chat.model.file.metadata
    info = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.") and isinstance(v, (int, float, str))}
    capabilities = ["embedding"] if server.embedder else (
        ["completion"] + (["tools"] if chat.tool_form else []) + (["thinking"] if chat.thinks else [])
        + (["vision"] if chat.model.tower else []))
    return JSONResponse({"modelfile": "", "parameters": "", "template": chat.template.source,
                         "details": _details(server), "model_info": info, "capabilities": capabilities})


async def embed(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    server.check_model(body.get("model"))
    inputs = embedding_inputs(body.get("input"))
    truncate = boolean(body, "truncate")
    start = time.perf_counter()
    vectors, tokens = await server.embed(inputs, truncate=truncate is not False,
                                         dimensions=integer(body, "dimensions", 1))
    return JSONResponse({"model": server.chat.name, "embeddings": vectors.tolist(),
                         "total_duration": _ns(time.perf_counter() - start), "load_duration": 0,
                         "prompt_eval_count": tokens})


async def embeddings(server: Server, request: Request) -> Response:
    """The older single-input route: `prompt` in, `embedding` out."""
    body = await server.read_json(request)
    server.check_model(body.get("model"))
    prompt = string(body, "prompt")
    if not prompt:
        raise RequestError("prompt is required (a non-empty string)")
    vectors, _ = await server.embed([prompt], truncate=True, dimensions=None)
    return JSONResponse({"embedding": vectors[0].tolist()})


async def version(server: Server, request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def cancel(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    rid = body.get("id") or body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise RequestError("id is required: the request id (X-Request-Id header of the response to cancel)")
    server.require_ready()
    if not server.worker.cancel(rid):
        raise RequestError(f"no queued or running request with id '{rid}'", status=404)
    return JSONResponse({"id": rid, "cancelled": True})


def routes(server: Server) -> list[Route]:
    return [
        Route("/api/chat", server.endpoint(partial(chat, server)), methods=["POST"]),
        Route("/api/generate", server.endpoint(partial(generate, server)), methods=["POST"]),
        Route("/api/tags", server.endpoint(partial(tags, server)), methods=["GET"]),
        Route("/api/ps", server.endpoint(partial(ps, server)), methods=["GET"]),
        Route("/api/show", server.endpoint(partial(show, server)), methods=["POST"]),
        Route("/api/embed", server.endpoint(partial(embed, server)), methods=["POST"]),
        Route("/api/embeddings", server.endpoint(partial(embeddings, server)), methods=["POST"]),
        Route("/api/version", server.endpoint(partial(version, server)), methods=["GET"]),
        Route("/api/cancel", server.endpoint(partial(cancel, server)), methods=["POST"]),
    ]
