"""The OpenAI routes through the official `openai` client (and raw SSE where the client hides details)."""

import httpx
import pytest

from serve_helpers import sse

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CATS = [{"role": "user", "content": "Tell me about cats."}]


def test_chat_answers_capital_of_france_with_paris(smol):
    r = smol.openai().chat.completions.create(model=smol.model, messages=CAPITAL, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion"
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_assembles_to_the_non_streamed_answer(smol):
    client = smol.openai()
    kwargs = dict(model=smol.model, messages=CATS, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len(chunks) > 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    final = chunks[-1]
    assert final.choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert final.usage.completion_tokens == full.usage.completion_tokens == 24
    assert final.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_ends_with_done_after_the_finish_chunk(smol):
    body = {"model": smol.model, "messages": CATS, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smol.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, done = sse(r)
    assert done
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["id"] == r.headers["x-request-id"] for c in chunks)


def test_request_id_header_is_echoed_and_is_the_completion_id(smol):
    body = {"model": smol.model, "messages": CAPITAL, "max_tokens": 2}
    r = httpx.post(f"{smol.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "my-req.1"}, timeout=120)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-req.1" == r.json()["id"]
    r = httpx.post(f"{smol.url}/v1/chat/completions", json=body, timeout=120)
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("chatcmpl-")


def test_invalid_request_id_header_is_refused(smol):
    body = {"model": smol.model, "messages": CAPITAL, "max_tokens": 2}
    r = httpx.post(f"{smol.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "no spaces!"}, timeout=60)
    assert r.status_code == 400
    assert "X-Request-Id" in r.json()["error"]["message"]


def test_completions_stream_and_non_stream_agree(smol):
    client = smol.openai()
    kwargs = dict(model=smol.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion"
    assert full.choices[0].text.strip()
    assert full.choices[0].finish_reason in ("stop", "length")
    assert 0 < full.usage.completion_tokens <= 8
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_completions_accept_a_list_of_one_prompt(smol):
    client = smol.openai()
    a = client.completions.create(model=smol.model, prompt="Hello, my name is", max_tokens=5, temperature=0)
    b = client.completions.create(model=smol.model, prompt=["Hello, my name is"], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_models_lists_the_one_served_model(smol):
    models = list(smol.openai().models.list())
    assert [m.id for m in models] == ["smollm2-135m"]
    assert models[0].object == "model" and models[0].owned_by == "pagelm"


def test_max_completion_tokens_limits_the_answer(smol):
    r = smol.openai().chat.completions.create(model=smol.model, messages=CATS, max_completion_tokens=3,
                                              temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_answer(smol):
    client = smol.openai()
    full = client.chat.completions.create(model=smol.model, messages=CAPITAL, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert " is " in text
    cut = client.chat.completions.create(model=smol.model, messages=CAPITAL, max_tokens=16, temperature=0,
                                         stop=[" is "])
    assert cut.choices[0].message.content == text[: text.index(" is ")]
    assert cut.choices[0].finish_reason == "stop"


# -- reasoning on the synthetic Qwen3.5 ------------------------------------------------------

def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _ask(server, **extra):
    return server.openai().chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=12,
                                                   temperature=0, **extra).choices[0].message


@pytest.mark.parametrize("extra", [{"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
                                   {"reasoning_effort": "high"}, {"extra_body": {"think": True}}],
                         ids=["chat_template_kwargs", "reasoning_effort", "think"])
def test_qwen_thinking_on_puts_the_answer_in_reasoning_content(qwen, extra):
    message = _ask(qwen, **extra)
    assert _reasoning(message)
    assert message.content == ""


@pytest.mark.parametrize("extra", [{"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                                   {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"},
                                   {"extra_body": {"think": False}}],
                         ids=["chat_template_kwargs", "reasoning_effort-none", "reasoning_effort-minimal", "think"])
def test_qwen_thinking_off_puts_the_answer_in_content(qwen, extra):
    message = _ask(qwen, **extra)
    assert message.content
    assert not _reasoning(message)


def test_qwen_thinking_aliases_give_the_same_reasoning(qwen):
    a = _ask(qwen, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    b = _ask(qwen, reasoning_effort="high")
    assert _reasoning(a) == _reasoning(b)


def test_qwen_streamed_reasoning_assembles_to_the_non_streamed_one(qwen):
    client = qwen.openai()
    kwargs = dict(model=qwen.model, messages=CAPITAL, max_tokens=12, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    full = client.chat.completions.create(**kwargs).choices[0].message
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(_reasoning(c.choices[0].delta) or "" for c in chunks) == _reasoning(full)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.content == ""


def test_bad_reasoning_effort_is_refused(qwen):
    r = httpx.post(f"{qwen.url}/v1/chat/completions", timeout=60,
                   json={"model": qwen.model, "messages": CAPITAL, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("question", ["Say hello in Japanese, Chinese and Russian.",
                                      "Write three emojis about the sun."])
def test_streamed_non_ascii_text_matches_and_is_never_split_mid_character(smol, question):
    client = smol.openai()
    kwargs = dict(model=smol.model, messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert any(ord(c) > 127 for c in text)
    parts = [c.choices[0].delta.content for c in client.chat.completions.create(**kwargs, stream=True)
             if c.choices and c.choices[0].delta.content]
    assert "".join(parts) == text
    # a replacement character may only end an answer cut off by the token limit
    assert "\ufffd" not in text[:-1]
    assert not text.endswith("\ufffd") or full.choices[0].finish_reason == "length"
