"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Streaming answers are server-sent events of `chat.completion.chunk` (or `text_completion`)
objects ending with `data: [DONE]`; reasoning arrives as `reasoning_content` deltas.
"""

from __future__ import annotations

import base64
import json
import time
from functools import partial
from typing import AsyncIterator

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagelm.chat.model import EFFORTS
from pagelm.chat.tools import ToolCall
from pagelm.serve.core import JsonAnswer, Server, events
from pagelm.serve.requests import (RequestError, boolean, embedding_inputs, integer, messages_from, prediction_text,
                                   sampling, stop_strings, string, tool_choice_from, tools_from)
from pagelm.serve.worker import Delta, Job, Result

REASONING_EFFORT_OFF = {"none", "minimal"}


def _think(body: dict) -> bool | str | None:
    """enable_thinking from chat_template_kwargs, or the `think` / `reasoning_effort` aliases (an
    effort of low, medium or high is passed on as such: chat.model.EFFORTS)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if kwargs and kwargs.get("enable_thinking") is not None:
        return boolean(kwargs, "enable_thinking", where="chat_template_kwargs.")
    if body.get("think") is not None:
        return boolean(body, "think")
    effort = string(body, "reasoning_effort")
    if effort is not None:
        if effort not in {"none", "minimal", "low", "medium", "high"}:
            raise RequestError("reasoning_effort must be none, minimal, low, medium or high", param="reasoning_effort")
        return effort if effort in EFFORTS else effort not in REASONING_EFFORT_OFF
    return None


def _json_answer(value) -> JsonAnswer | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonAnswer()
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                               param="response_format")
        return JsonAnswer(schema)
    raise RequestError('response_format.type must be "text", "json_object" or "json_schema"', param="response_format")


def _tool_call(call: ToolCall, index: int | None = None) -> dict:
    """A call as OpenAI writes it: in a message, or (with its index) in a streamed delta."""
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return entry if index is None else {"index": index, **entry}


def _split(parts: list) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of what an answer stream gave back."""
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


def _common(server: Server, body: dict) -> tuple:
    server.check_model(body.get("model"))
    if integer(body, "n", 1, 1) not in (None, 1):
        raise RequestError("n must be 1", param="n")
    max_tokens = integer(body, "max_completion_tokens", 0)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 0)
    params = sampling(body, server.max_tokens(max_tokens))
    stream = bool(boolean(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    return params, stop_strings(body.get("stop")), stream


def _usage(result: Result) -> dict:
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
             "total_tokens": result.prompt_tokens + result.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
    if result.accepted_prediction_tokens is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": result.accepted_prediction_tokens,
                                              "rejected_prediction_tokens": result.rejected_prediction_tokens}
    return usage


def _prediction(server: Server, body: dict) -> list[int] | None:
    """The tokens of the request's predicted output (drafts checked against the answer), or None."""
    text = prediction_text(body.get("prediction"))
    return None if text is None else server.require_ready().tokenizer.encode(text)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _model_name(server: Server) -> str:
    return server.require_ready().name


async def _stream(job: Job, chunks) -> AsyncIterator[str]:
    try:
        async for event in events(job):
            for chunk in chunks(event):
                yield _sse(chunk)
    except RequestError as e:
        yield _sse({"error": {"message": str(e), "type": "server_error", "code": None, "param": None}})
    yield "data: [DONE]\n\n"


def _streaming(job: Job, chunks) -> Response:
    """The answer as server-sent events, one a `chunks(event)` object, ending with [DONE]."""
    return StreamingResponse(_stream(job, chunks), media_type="text/event-stream",
                             headers={"X-Request-Id": job.id, "Cache-Control": "no-cache"})


async def chat_completions(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    params, stop, streamed = _common(server, body)
    messages, images = messages_from(body.get("messages"), "openai")
    tools = tools_from(body.get("tools"))
    parallel = boolean(body, "parallel_tool_calls")
    plan = await server.plan_chat(messages, _think(body), tools, tool_choice_from(body.get("tool_choice"), tools),
                                  parallel is not False, _json_answer(body.get("response_format")), images)
    job = server.start(request, plan.prompt, params, stop, "chatcmpl", grammar=plan.grammar,
                       prediction=_prediction(server, body))
    created, name = int(time.time()), _model_name(server)
    head = {"id": job.id, "object": "chat.completion.chunk", "created": created, "model": name}
    calls = plan.answer_stream()

    def finish_reason(result: Result) -> str:
        return "tool_calls" if calls.calls and result.finish_reason == "stop" else result.finish_reason

    if streamed:
        first = [True]

        def choice(delta: dict, reason: str | None = None) -> dict:
            if first[0]:
                delta, first[0] = {"role": "assistant", **delta}, False
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

        def chunks(event) -> list[dict]:
            delta = {}
            if isinstance(event, Delta):
                if event.reasoning:
                    delta["reasoning_content"] = event.reasoning
                pieces = calls.push(event.content)
            else:
                pieces = calls.finish()
            content, new_calls = _split(pieces)
            if content:
                delta["content"] = content
            out = [choice(delta)] if delta else []
            first_index = len(calls.calls) - len(new_calls)
            out += [choice({"tool_calls": [_tool_call(call, first_index + i)]}) for i, call in enumerate(new_calls)]
            if isinstance(event, Result):
                out.append({**choice({}, finish_reason(event)), "usage": _usage(event)})
            return out

        return _streaming(job, chunks)

    reasoning, parts, result = [], [], None
    async for event in events(job, request):
        if isinstance(event, Delta):
            reasoning.append(event.reasoning)
            parts += calls.push(event.content)
        else:
            result = event
    content, found = _split(parts + calls.finish())
    message = {"role": "assistant", "content": content if content or not found else None}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if found:
        message["tool_calls"] = [_tool_call(c) for c in found]
    return JSONResponse({"id": job.id, "object": "chat.completion", "created": created, "model": name,
                         "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result)}],
                         "usage": _usage(result)}, headers={"X-Request-Id": job.id})


async def completions(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    params, stop, streamed = _common(server, body)
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise RequestError("prompt must be a string (or a list of one string)", param="prompt")
    prompt = await server.raw_prompt(text)
    job = server.start(request, prompt, params, stop, "cmpl", prediction=_prediction(server, body))
    created, name = int(time.time()), _model_name(server)
    head = {"id": job.id, "object": "text_completion", "created": created, "model": name}

    if streamed:
        def chunks(event) -> list[dict]:
            if isinstance(event, Delta):
                return [{**head, "choices": [{"index": 0, "text": event.content, "finish_reason": None,
                                              "logprobs": None}]}]
            return [{**head, "choices": [{"index": 0, "text": "", "finish_reason": event.finish_reason,
                                          "logprobs": None}], "usage": _usage(event)}]

        return _streaming(job, chunks)

    parts, result = [], None
    async for event in events(job, request):
        if isinstance(event, Delta):
            parts.append(event.content)
        else:
            result = event
    return JSONResponse({**head, "choices": [{"index": 0, "text": "".join(parts), "logprobs": None,
                                              "finish_reason": result.finish_reason}],
                         "usage": _usage(result)}, headers={"X-Request-Id": job.id})


async def embeddings(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    server.check_model(body.get("model"))
    inputs = embedding_inputs(body.get("input"))
    encoding = string(body, "encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise RequestError('encoding_format must be "float" or "base64"', param="encoding_format")
    vectors, tokens = await server.embed(inputs, truncate=False, dimensions=integer(body, "dimensions", 1))

    def encoded(vector: np.ndarray):
        return base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()

    return JSONResponse({"object": "list", "model": _model_name(server),
                         "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def models(server: Server, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": _model_name(server), "object": "model",
                                                     "created": int(server.started), "owned_by": "pagelm"}]})


def routes(server: Server) -> list[Route]:
    return [
        Route("/v1/chat/completions", server.endpoint(partial(chat_completions, server)), methods=["POST"]),
        Route("/v1/completions", server.endpoint(partial(completions, server)), methods=["POST"]),
        Route("/v1/embeddings", server.endpoint(partial(embeddings, server)), methods=["POST"]),
        Route("/v1/models", server.endpoint(partial(models, server)), methods=["GET"]),
    ]
