"""Checking request bodies: typed fields with ranges, messages in either protocol's shape,
images (data URLs or base64) decoded and recognised. Everything wrong raises RequestError
naming the field; the protocol modules turn it into their own error shape.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from pagelm.sampling import SamplingParams

MAX_IMAGE_BYTES = 20 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg", b"GIF87a": "gif", b"GIF89a": "gif"}
ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and the offending field if one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


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


def sampling(fields: dict, max_tokens: int, where: str = "") -> SamplingParams:
    """SamplingParams from OpenAI-named fields (temperature, top_p, top_k, min_p, seed,
    presence/frequency/repeat penalties), already pulled out of either protocol's body."""
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


def messages_from(value: Any, protocol: str) -> tuple[list[dict], list[bytes]]:
    """(template messages, images) from an OpenAI or Ollama `messages` list."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", param="messages")
    messages, images = [], []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {type(message).__name__}", param="messages")
        role = message.get("role")
        if role not in ROLE_ALIASES:
            raise RequestError(f"{where}.role must be one of system, user, assistant, tool (or developer), "
                               f"got {role!r}", param="messages")
        content = message.get("content")
        if isinstance(content, list) and protocol == "openai":
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    images.append(decode_image(url, f"{where}.content[{j}].image_url"))
                else:
                    raise RequestError(f"{where}.content[{j}] must be a text or image_url part", param="messages")
            content = "\n".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string"
                               + (" or a list of content parts" if protocol == "openai" else ""), param="messages")
        plain = {"role": ROLE_ALIASES[role], "content": content}
        reasoning = message.get("reasoning_content") if protocol == "openai" else message.get("thinking")
        if isinstance(reasoning, str) and reasoning:
            plain["reasoning_content"] = reasoning
        if protocol == "ollama" and message.get("images") is not None:
            if not isinstance(message["images"], list):
                raise RequestError(f"{where}.images must be a list of base64 strings", param="messages")
            images += [decode_image(img, f"{where}.images[{j}]") for j, img in enumerate(message["images"])]
        messages.append(plain)
    return messages, images


def request_id(header: str | None) -> str | None:
    if header is None:
        return None
    if not REQUEST_ID.fullmatch(header):
        raise RequestError("X-Request-Id must be 1-128 characters of letters, digits and . _ : -")
    return header
