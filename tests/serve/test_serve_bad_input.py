"""Bad requests get a 4xx error in the protocol's own shape, and the server keeps answering."""

import base64
import json
import struct
import zlib

import httpx
import pytest

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-135m"


def tiny_png() -> bytes:
    """A real 1x1 RGB PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00"))
            + chunk(b"IEND", b""))


PNG64 = base64.b64encode(tiny_png()).decode()
TEXT64 = base64.b64encode(b"hello, this is not an image").decode()


def openai_image(url: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def ollama_image(image: str) -> dict:
    return {"model": MODEL, "stream": False,
            "messages": [{"role": "user", "content": "What is in this picture?", "images": [image]}]}


CHAT = {"model": MODEL, "messages": CAPITAL, "max_tokens": 4}
OCHAT = {"model": MODEL, "messages": CAPITAL, "stream": False, "options": {"num_predict": 4}}


def _with(body: dict, field: str) -> bytes:
    """`body` as JSON text with `field` (raw JSON text, which may be what JSON does not allow) added."""
    return (json.dumps(body)[:-1] + ", " + field + "}").encode()


# (id, method, path, body (bytes sent as is, else JSON), status, words the error message must contain)
CASES = [
    ("openai-malformed-json", "POST", "/v1/chat/completions", b'{"model": "x", ', 400, ["malformed JSON"]),
    ("ollama-malformed-json", "POST", "/api/chat", b'{"model": ', 400, ["malformed JSON"]),
    ("openai-not-utf8", "POST", "/v1/chat/completions", b'\xff\xfe{"a": 1}', 400, ["malformed JSON"]),
    ("openai-empty-body", "POST", "/v1/chat/completions", b"", 400, ["malformed JSON"]),
    ("openai-body-list", "POST", "/v1/chat/completions", b"[1, 2]", 400, ["JSON object", "list"]),
    ("ollama-body-string", "POST", "/api/generate", b'"hello"', 400, ["JSON object", "str"]),
    ("openai-temperature-string", "POST", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400,
     ["temperature", "number"]),
    ("openai-temperature-range", "POST", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400,
     ["temperature"]),
    ("openai-max-tokens-string", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": "5"}, 400,
     ["max_tokens", "integer"]),
    ("openai-max-tokens-float", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 5.5}, 400, ["max_tokens"]),
    ("openai-max-tokens-negative", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400,
     ["max_tokens"]),
    ("openai-stream-string", "POST", "/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, ["stream"]),
    ("openai-messages-string", "POST", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, ["messages"]),
    ("openai-messages-empty", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, 400, ["messages"]),
    ("openai-messages-missing", "POST", "/v1/chat/completions", {"model": MODEL}, 400, ["messages"]),
    ("openai-message-not-object", "POST", "/v1/chat/completions", {**CHAT, "messages": ["hi"]}, 400,
     ["messages[0]"]),
    ("openai-bad-role", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role", "wizard"]),
    ("openai-content-number", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 42}]}, 400, ["content"]),
    ("openai-n-2", "POST", "/v1/chat/completions", {**CHAT, "n": 2}, 400, ["n must be"]),
    ("openai-unknown-model", "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, ["gpt-9"]),
    ("openai-model-missing", "POST", "/v1/chat/completions", {"messages": CAPITAL}, 400, ["model"]),
    ("openai-stop-not-strings", "POST", "/v1/chat/completions", {**CHAT, "stop": [1, 2]}, 400, ["stop"]),
    ("openai-chat-template-kwargs-list", "POST", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": [1]},
     400, ["chat_template_kwargs"]),
    ("completions-prompt-number", "POST", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, ["prompt"]),
    ("ollama-unknown-model", "POST", "/api/chat", {**OCHAT, "model": "llama-9000"}, 404, ["llama-9000"]),
    ("ollama-messages-not-list", "POST", "/api/chat", {**OCHAT, "messages": {"role": "user"}}, 400, ["messages"]),
    ("ollama-empty-messages", "POST", "/api/chat", {**OCHAT, "messages": []}, 400, ["messages"]),
    ("ollama-bad-role", "POST", "/api/chat", {**OCHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     ["role"]),
    ("ollama-options-temperature-string", "POST", "/api/chat", {**OCHAT, "options": {"temperature": "hot"}}, 400,
     ["options.temperature"]),
    ("ollama-options-num-predict-string", "POST", "/api/generate",
     {"model": MODEL, "prompt": "hi", "options": {"num_predict": "5"}}, 400, ["options.num_predict"]),
    ("ollama-options-not-object", "POST", "/api/generate", {"model": MODEL, "prompt": "hi", "options": [1]}, 400,
     ["options"]),
    ("ollama-prompt-missing", "POST", "/api/generate", {"model": MODEL}, 400, ["prompt"]),
    ("ollama-num-ctx-zero", "POST", "/api/generate", {"model": MODEL, "prompt": "hi", "options": {"num_ctx": 0}},
     400, ["num_ctx"]),
    ("openai-unknown-route", "POST", "/v1/audio/speech", {"model": MODEL}, 404, ["/v1/audio/speech"]),
    ("ollama-unknown-route", "GET", "/api/nothing", None, 404, ["/api/nothing"]),
    ("openai-wrong-method", "GET", "/v1/chat/completions", None, 405, ["GET"]),
    ("ollama-wrong-method", "GET", "/api/chat", None, 405, ["GET"]),
    ("openai-models-wrong-method", "POST", "/v1/models", {}, 405, ["POST"]),
    # images: decoded and recognised, then refused because the model has no vision
    ("openai-png-no-vision", "POST", "/v1/chat/completions", openai_image(f"data:image/png;base64,{PNG64}"), 400,
     ["no vision", MODEL]),
    ("ollama-png-no-vision", "POST", "/api/chat", ollama_image(PNG64), 400, ["no vision"]),
    ("ollama-generate-png-no-vision", "POST", "/api/generate",
     {"model": MODEL, "prompt": "What is this?", "images": [PNG64], "stream": False}, 400, ["no vision"]),
    ("openai-image-bad-base64", "POST", "/v1/chat/completions", openai_image("data:image/png;base64,@@@notbase64"),
     400, ["base64"]),
    ("ollama-image-bad-base64", "POST", "/api/chat", ollama_image("not base64 at all!"), 400, ["base64"]),
    ("openai-image-not-an-image", "POST", "/v1/chat/completions", openai_image(f"data:image/png;base64,{TEXT64}"),
     400, ["not a PNG"]),
    ("ollama-image-not-an-image", "POST", "/api/generate",
     {"model": MODEL, "prompt": "x", "images": [TEXT64], "stream": False}, 400, ["not a PNG"]),
    ("openai-image-remote-url", "POST", "/v1/chat/completions", openai_image("http://example.com/cat.png"), 400,
     ["remote image URLs"]),
    ("openai-image-https-url", "POST", "/v1/chat/completions", openai_image("https://example.com/cat.png"), 400,
     ["remote image URLs"]),
    ("openai-image-data-url-not-image", "POST", "/v1/chat/completions",
     openai_image(f"data:text/plain;base64,{TEXT64}"), 400, ["data URL"]),
    ("ollama-images-not-list", "POST", "/api/generate", {"model": MODEL, "prompt": "x", "images": "abc"}, 400,
     ["images"]),
    # numbers JSON does not have (Python's json reads them), and one past Python's digit limit
    *[(f"openai-{field}-nan", "POST", "/v1/chat/completions", _with(CHAT, f'"{field}": NaN'), 400, [field, "finite"])
      for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")],
    ("openai-temperature-infinity", "POST", "/v1/chat/completions", _with(CHAT, '"temperature": -Infinity'), 400,
     ["temperature", "finite"]),
    ("ollama-repeat-penalty-nan", "POST", "/api/chat", _with(OCHAT, '"options": {"repeat_penalty": NaN}'), 400,
     ["options.repeat_penalty", "finite"]),
    ("ollama-nan-deep-in-a-message", "POST", "/api/chat",
     _with(OCHAT, '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
                  '"properties": {"x": {"type": "number", "maximum": NaN}}}}}]'), 400, ["tools[0]", "maximum"]),
    ("openai-huge-integer", "POST", "/v1/chat/completions", _with(CHAT, '"seed": ' + "9" * 5000), 400,
     ["malformed JSON"]),
    ("openai-deep-nesting", "POST", "/v1/chat/completions", _with(CHAT, '"user": ' + "[" * 100_000 + "]" * 100_000),
     400, ["nested deeper"]),
    ("ollama-moderate-nesting", "POST", "/api/chat", _with(OCHAT, '"x": ' + "[" * 500 + "]" * 500), 400,
     ["x", "nested deeper than 64"]),
    # fields of the wrong shape where a hashable value was taken for granted
    ("openai-role-list", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": ["user"], "content": "hi"}]},
     400, ["role"]),
    ("ollama-role-object", "POST", "/api/chat", {**OCHAT, "messages": [{"role": {"a": 1}, "content": "hi"}]}, 400,
     ["role"]),
    ("openai-tool-call-id-list", "POST", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": ["c1"], "content": "4"}]}, 400, ["tool_call_id"]),
    ("openai-schema-type-list-of-objects", "POST", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": [{}]}}}}, 400,
     ["not a valid JSON schema", "type"]),
    ("ollama-format-schema-bad-required", "POST", "/api/chat",
     {**OCHAT, "format": {"type": "object", "required": [{"a": 1}]}}, 400, ["not a valid JSON schema", "required"]),
    ("openai-tool-required-object", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}},
                                    "required": [{"a": 1}]}}}]}, 400, ["tools[0].function.parameters", "required"]),
]


@pytest.mark.parametrize("method, path, body, status, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_protocol_error_and_server_still_answers(smol, method, path, body, status, words):
    assert smol.model == MODEL
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body} if body is not None else {}
    r = httpx.request(method, f"{smol.url}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    if path.startswith("/v1"):
        assert set(error) == {"message", "type", "param", "code"}
        message = error["message"]
        assert error["type"] != "server_error"
    else:
        assert isinstance(error, str)
        message = error
    for word in words:
        assert word in message, message
    if status == 405:
        assert r.headers.get("allow"), "a 405 must say which methods are allowed"
    ok = httpx.post(f"{smol.url}/api/generate", timeout=120,
                    json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    assert ok.status_code == 200 and ok.json()["done"] is True


def test_unknown_model_has_openai_code_and_param(smol):
    r = httpx.post(f"{smol.url}/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, timeout=60)
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"] == "not_found_error"


def test_wrong_type_names_the_param(smol):
    r = httpx.post(f"{smol.url}/v1/chat/completions", json={**CHAT, "temperature": "hot"}, timeout=60)
    assert r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_model_name_variants_are_accepted(smol, smollm2_gguf):
    for name in (MODEL, MODEL + ":latest", "smollm2-135m.gguf", smollm2_gguf):
        r = httpx.post(f"{smol.url}/v1/chat/completions", json={**CHAT, "model": name, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, name


def test_openai_client_raises_bad_request_with_the_message(smol):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        smol.openai().chat.completions.create(model=MODEL, messages=CAPITAL, temperature=5000)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        smol.openai().chat.completions.create(model="gpt-9", messages=CAPITAL)
