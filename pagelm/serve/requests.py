"""Checking request bodies: typed fields with ranges, messages in either protocol's shape,
images (data URLs or base64) decoded and recognised. Everything wrong raises RequestError
naming the field; the protocol modules turn it into their own error shape.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any

from pagelm.chat.grammar import GrammarError, check_schema
from pagelm.chat.tools import Tool
from pagelm.engine.sampling import SamplingParams

MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGES = 16  # per request
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg", b"GIF87a": "gif", b"GIF89a": "gif"}
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 << 10
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOOL_CHOICES = ("auto", "none", "required")
ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request
MAX_JSON_DEPTH = 64  # objects and lists inside each other; a deeper body is refused before any field is read


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and the offending field if one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


def check_body(body: dict) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH, holding NaN or Infinity (Python's json
    reads them; JSON has no such numbers) or a lone surrogate (an escape like \\ud800 that is no
    character: nothing can encode it), naming where; walked without recursion."""
    pending: list[tuple[Any, str, int]] = [(value, _encodable(key), 1) for key, value in body.items()]
    while pending:
        value, where, depth = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{where} must be a finite number, got {value}", param=_param(where))
        if isinstance(value, str):
            _encodable(value, where)
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise RequestError(f"{where}: the body is nested deeper than {MAX_JSON_DEPTH} levels",
                                   param=_param(where))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            pending += [(item, f"{where}.{_encodable(key, where)}" if isinstance(value, dict) else f"{where}[{key}]",
                         depth + 1) for key, item in items]


def _encodable(text: str, where: str | None = None) -> str:
    """`text` if it is Unicode that can be written out (no lone surrogate), else a 400 naming where
    (None: a field name of the body)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise RequestError(f"{where or 'a field name'} holds a lone surrogate escape (\\ud800-\\udfff alone), "
                           f"which is not a character", param=where and _param(where)) from None
    return text


def _param(where: str) -> str:
    """The top-level field of a place in the body (`messages` of `messages[0].content`)."""
    return re.split(r"[.\[]", where, maxsplit=1)[0]


def schema_from(value: Any, where: str, param: str) -> dict:
    """A JSON schema a request gives (an answer's or a tool's), checked against JSON Schema's meta-schema."""
    try:
        check_schema(value, where)
    except GrammarError as e:
        raise RequestError(str(e), param=param) from None
    return value


def _typed(body: dict, key: str, kinds: tuple[type, ...], what: str, where: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(f"{where}{key} must be {what}, got {type(value).__name__}", param=key)
    return value


def number(body: dict, key: str, lo: float | None = None, hi: float | None = None, where: str = "") -> float | None:
    value = _typed(body, key, (int, float), "a number", where)
    if value is not None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise RequestError(f"{where}{key} must be in {bounds}, got {value}", param=key)
    return value


def integer(body: dict, key: str, lo: int | None = None, hi: int | None = None, where: str = "") -> int | None:
    value = _typed(body, key, (int,), "an integer", where)
    if value is not None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(f"{where}{key} must be {limit}, got {value}", param=key)
    return value


def boolean(body: dict, key: str, where: str = "") -> bool | None:
    return _typed(body, key, (bool,), "true or false", where)


def string(body: dict, key: str, where: str = "") -> str | None:
    return _typed(body, key, (str,), "a string", where)


def stop_strings(value: Any, where: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"{where} must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise RequestError(f"{where}: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters",
                           param="stop")
    return tuple(s for s in stops if s)


def prediction_text(value: Any) -> str | None:
    """The text of OpenAI's `prediction` ({"type": "content", "content": a string or text parts}),
    None when absent."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise RequestError('prediction must be {"type": "content", "content": ...}', param="prediction")
    content = value.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError("prediction.content must be a string or a list of text parts", param="prediction.content")
    return _encodable(content, "prediction.content")


def sampling(fields: dict, max_tokens: int, where: str = "") -> SamplingParams:
    """SamplingParams from OpenAI-named fields (temperature, top_p, top_k, min_p, seed,
    presence/frequency/repeat penalties, reasoning_budget), already pulled out of either protocol's body."""
    seed = integer(fields, "seed", where=where)
    top_p = number(fields, "top_p", 0, 1, where)
    top_k = integer(fields, "top_k", 0, where=where) or 0
    return SamplingParams(
        temperature=number(fields, "temperature", 0, 100, where) or 0.0,
        top_p=1.0 if not top_p else top_p,
        top_k=1 if top_p == 0 else top_k,  # top_p 0 keeps only the most likely token
        min_p=number(fields, "min_p", 0, 1, where) or 0.0,
        presence_penalty=number(fields, "presence_penalty", -2, 2, where) or 0.0,
        frequency_penalty=number(fields, "frequency_penalty", -2, 2, where) or 0.0,
        repetition_penalty=number(fields, "repeat_penalty", 0.01, 100, where) or 1.0,
        seed=None if seed is None else seed % 2**63,
        max_tokens=max_tokens,
        reasoning_budget=integer(fields, "reasoning_budget", 0, where=where),
    )


def decode_image(data: Any, where: str) -> bytes:
    """Image bytes from a data URL or bare base64; the format must be one we recognise."""
    if not isinstance(data, str):
        raise RequestError(f"{where}: an image must be a base64 string or data URL, got {type(data).__name__}")
    if data.startswith(("http://", "https://")):
        raise RequestError(f"{where}: remote image URLs are not fetched; send the image as a data URL")
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise RequestError(f"{where}: a data URL must look like data:image/<type>;base64,<data>")
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RequestError(f"{where}: image larger than {MAX_IMAGE_BYTES >> 20} MiB", status=413)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: image is not valid base64") from None
    if not any(raw.startswith(m) for m in IMAGE_MAGIC) and not (raw[:4] == b"RIFF" and raw[8:12] == b"WEBP"):
        raise RequestError(f"{where}: not a PNG, JPEG, GIF or WebP image")
    return raw


def tools_from(value: Any) -> list[Tool]:
    """The functions a request offers, from OpenAI's (and Ollama's) `tools` list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                           param="tools")
    if len(value) > MAX_TOOLS or len(json.dumps(value)) > MAX_TOOLS_BYTES:
        raise RequestError(f"tools: at most {MAX_TOOLS} tools of at most {MAX_TOOLS_BYTES >> 10} KiB in all",
                           param="tools")
    tools = {}
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or entry.get("type", "function") != "function":
            raise RequestError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                               f'...}}}}', param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, _ . or -, got {name!r}",
                               param="tools")
        if name in tools:
            raise RequestError(f"{where}: a second function named {name!r}", param="tools")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string", param="tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
                or not isinstance(parameters.get("properties", {}), dict)):
            raise RequestError(f"{where}.function.parameters must be a JSON schema of type object (with "
                               f"\"properties\" an object)", param="tools")
        schema_from(parameters, f"{where}.function.parameters", "tools")
        tools[name] = Tool(name, description, parameters)
    return list(tools.values())


def tool_choice_from(value: Any, tools: list[Tool]) -> str | Tool:
    """`auto`, `none`, `required`, or the one Tool a request names."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise RequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                               f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}', param="tool_choice")
        if value == "required" and not tools:
            raise RequestError("tool_choice is required but the request offers no tools", param="tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must name a function as {"type": "function", "function": {"name": ...}}',
                           param="tool_choice")
    chosen = next((t for t in tools if t.name == name), None)
    if chosen is None:
        raise RequestError(f"tool_choice names function {name!r}, which is not among the request's tools",
                           param="tool_choice")
    return chosen


def _tool_calls(value: Any, protocol: str, where: str) -> list[dict]:
    """An assistant message's tool calls as templates read them: arguments as an object."""
    if not isinstance(value, list):
        raise RequestError(f"{where}.tool_calls must be a list", param="messages")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.tool_calls[{j}] must have function.name", param="messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                   param="messages") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object"
                               + (" (as a string)" if protocol == "openai" else ""), param="messages")
        plain = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            plain["id"] = call["id"]
        calls.append(plain)
    return calls


def messages_from(value: Any, protocol: str) -> tuple[list[dict], list[bytes]]:
    """(template messages, images) from an OpenAI or Ollama `messages` list. A message with
    images gets a list of content parts (`{"type": "image"}` where each image goes, Ollama's
    before the text), as chat templates read them; the images' bytes come in that order."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", param="messages")
    messages, images, call_ids = [], [], set()
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {type(message).__name__}", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLE_ALIASES:
            raise RequestError(f"{where}.role must be one of system, user, assistant, tool (or developer), "
                               f"got {role!r}", param="messages")
        content = message.get("content")
        if isinstance(content, list) and protocol == "openai":
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    images.append(decode_image(url, f"{where}.content[{j}].image_url"))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"{where}.content[{j}] must be a text or image_url part", param="messages")
            texts = [p["text"] for p in parts if p["type"] == "text"]
            content = parts if len(texts) < len(parts) else "\n".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string"
                               + (" or a list of content parts" if protocol == "openai" else ""), param="messages")
        plain = {"role": ROLE_ALIASES[role], "content": content}
        if role == "assistant" and message.get("tool_calls") is not None:
            plain["tool_calls"] = _tool_calls(message["tool_calls"], protocol, where)
            call_ids.update(c["id"] for c in plain["tool_calls"] if "id" in c)
        if role == "tool" and protocol == "openai":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise RequestError(f"{where}.tool_call_id {call_id!r} matches no tool call of an earlier assistant "
                                   f"message", param="messages")
            plain["tool_call_id"] = call_id
        if role == "tool" and isinstance(message.get("tool_name" if protocol == "ollama" else "name"), str):
            plain["name"] = message["tool_name" if protocol == "ollama" else "name"]
        reasoning = message.get("reasoning_content") if protocol == "openai" else message.get("thinking")
        if isinstance(reasoning, str) and reasoning:
            plain["reasoning_content"] = reasoning
        if protocol == "ollama" and message.get("images") is not None:
            if not isinstance(message["images"], list):
                raise RequestError(f"{where}.images must be a list of base64 strings", param="messages")
            images += [decode_image(img, f"{where}.images[{j}]") for j, img in enumerate(message["images"])]
            if message["images"]:
                plain["content"] = [*({"type": "image"} for _ in message["images"]), {"type": "text", "text": content}]
        if len(images) > MAX_IMAGES:
            raise RequestError(f"{where}: more than {MAX_IMAGES} images in one request", param="messages")
        messages.append(plain)
    return messages, images


def embedding_inputs(value: Any, param: str = "input") -> list[str | list[int]]:
    """The inputs of an embeddings request: a string, a list of strings, a list of token ids (one
    input) or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise RequestError(f"{param} must be a string, a list of strings, or token ids (a list of integers, or a "
                           f"list of such lists)", param=param)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"{param}: at most {MAX_EMBEDDING_INPUTS} inputs in one request, got {len(value)}",
                           param=param)
    for i, item in enumerate(value):
        tokens = isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in item)
        if not isinstance(item, str) and not tokens:
            raise RequestError(f"{param}[{i}] must be a string or a list of token ids (integers >= 0)", param=param)
    return value


def request_id(header: str | None) -> str | None:
    if header is None:
        return None
    if not REQUEST_ID.fullmatch(header):
        raise RequestError("X-Request-Id must be 1-128 characters of letters, digits and . _ : -")
    return header
