"""Cancelling: a client that goes away mid-stream, /api/cancel by request id, unknown ids."""

import json
import threading
import time

import httpx
from serve_helpers import sse

LONG = "Write a very long story about a dragon who lives in a castle."
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def _wait_idle(server, cancelled_at_least: int | None = None, deadline_s: float = 600) -> dict:
    """/api/ps once nothing runs or waits (and, if given, the cancelled count reached a value)."""
    end = time.monotonic() + deadline_s
    while True:
        ps = server.ps()["requests"]
        if not ps["running"] and ps["queued"] == 0 and (cancelled_at_least is None
                                                          or ps["cancelled"] >= cancelled_at_least):
            return ps
        assert time.monotonic() < end, f"server still busy: {ps}"
        time.sleep(0.05)


def _generate(server, **options) -> dict:
    r = httpx.post(f"{server.url}/api/generate", timeout=300,
                   json={"model": server.model, "prompt": LONG, "stream": False, "options": options})
    assert r.status_code == 200, r.text
    return r.json()


def test_ollama_client_disconnect_mid_stream_cancels_and_leaves_output_unchanged(smol):
    before = _generate(smol, num_predict=24)
    cancelled = _wait_idle(smol)["cancelled"]
    body = {"model": smol.model, "prompt": LONG, "options": {"num_predict": 1000}}
    with httpx.stream("POST", f"{smol.url}/api/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["done"] is False
    after_ps = _wait_idle(smol, cancelled_at_least=cancelled + 1)
    assert after_ps["cancelled"] == cancelled + 1
    after = _generate(smol, num_predict=24)
    assert after["response"] == before["response"]
    assert after["eval_count"] == before["eval_count"]


def test_openai_client_disconnect_mid_stream_cancels_and_leaves_output_unchanged(smol):
    client = smol.openai()
    messages = [{"role": "user", "content": LONG}]
    before = client.chat.completions.create(model=smol.model, messages=messages, max_tokens=24, temperature=0)
    cancelled = _wait_idle(smol)["cancelled"]
    stream = client.chat.completions.create(model=smol.model, messages=messages, max_tokens=1000, temperature=0,
                                            stream=True)
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].finish_reason is None
    stream.close()
    assert _wait_idle(smol, cancelled_at_least=cancelled + 1)["cancelled"] == cancelled + 1
    after = client.chat.completions.create(model=smol.model, messages=messages, max_tokens=24, temperature=0)
    assert after.choices[0].message.content == before.choices[0].message.content


def test_disconnect_of_a_non_streamed_request_cancels_it(smol):
    """The client gives up on a `stream: false` request while tokens are still flowing: the
    server must notice and stop generating (not run the 1000 tokens to the end)."""
    cancelled = _wait_idle(smol)["cancelled"]
    body = {"model": smol.model, "prompt": LONG, "stream": False, "options": {"num_predict": 1000}}
    try:
        try:
            httpx.post(f"{smol.url}/api/generate", json=body, headers={"X-Request-Id": "gone-1"}, timeout=1.5)
        except httpx.TimeoutException:
            pass
        assert _wait_idle(smol, cancelled_at_least=cancelled + 1)["cancelled"] == cancelled + 1
    finally:
        httpx.post(f"{smol.url}/api/cancel", json={"id": "gone-1"}, timeout=30)  # 404 once it ended
        _wait_idle(smol)


def test_api_cancel_by_request_id_ends_the_ollama_stream_with_cancelled(smol):
    body = {"model": smol.model, "prompt": LONG, "options": {"num_predict": 1000}}
    with httpx.stream("POST", f"{smol.url}/api/generate", json=body, headers={"X-Request-Id": "cancel-me-1"},
                      timeout=120) as r:
        assert r.headers["x-request-id"] == "cancel-me-1"
        lines = r.iter_lines()
        first = [json.loads(next(lines)) for _ in range(3)]
        c = httpx.post(f"{smol.url}/api/cancel", json={"id": "cancel-me-1"}, timeout=30)
        assert c.status_code == 200 and c.json() == {"id": "cancel-me-1", "cancelled": True}
        rest = [json.loads(line) for line in lines if line.strip()]
    records = first + rest
    assert records[-1]["done"] is True and records[-1]["done_reason"] == "cancelled"
    assert 3 <= records[-1]["eval_count"] < 1000
    normal = httpx.post(f"{smol.url}/api/chat", timeout=120, json={"model": smol.model, "messages": CAPITAL,
                                                                    "stream": False}).json()
    assert "Paris" in normal["message"]["content"] and normal["done_reason"] == "stop"


def test_api_cancel_by_request_id_ends_the_openai_stream_with_cancelled(smol):
    body = {"model": smol.model, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1000,
            "stream": True}
    with httpx.stream("POST", f"{smol.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "cancel-me-2"},
                      timeout=120) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        assert httpx.post(f"{smol.url}/api/cancel", json={"request_id": "cancel-me-2"}, timeout=30).status_code == 200
        chunks, done = sse(lines)
    assert done
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"
    assert chunks[-1]["usage"]["completion_tokens"] < 1000
    normal = smol.openai().chat.completions.create(model=smol.model, messages=CAPITAL, max_tokens=16, temperature=0)
    assert "Paris" in normal.choices[0].message.content


def test_api_cancel_of_a_queued_request(smol):
    """A request still waiting for a slot (every slot busy) ends as cancelled without generating."""
    results = {}

    def run(rid, num_predict):
        r = httpx.post(f"{smol.url}/api/generate", headers={"X-Request-Id": rid}, timeout=300,
                       json={"model": smol.model, "prompt": LONG, "stream": False,
                             "options": {"num_predict": num_predict}})
        results[rid] = r

    _wait_idle(smol)
    busy = [f"busy-{i}" for i in range(smol.ps()["slots"]["total"])]
    threads = [threading.Thread(target=run, args=(rid, 1000)) for rid in busy]
    for thread in threads:
        thread.start()
    end = time.monotonic() + 300
    while smol.ps()["slots"]["idle"]:
        assert time.monotonic() < end
        time.sleep(0.02)
    queued = threading.Thread(target=run, args=("queued-1", 50))
    queued.start()
    while smol.ps()["requests"]["queued"] < 1:
        assert time.monotonic() < end
        time.sleep(0.02)
    assert httpx.post(f"{smol.url}/api/cancel", json={"id": "queued-1"}, timeout=30).status_code == 200
    queued.join(300)
    assert results["queued-1"].json()["done_reason"] == "cancelled"
    assert results["queued-1"].json()["eval_count"] == 0
    for rid in busy:
        assert httpx.post(f"{smol.url}/api/cancel", json={"id": rid}, timeout=30).status_code == 200
    for thread in threads:
        thread.join(300)
    assert all(results[rid].json()["done_reason"] == "cancelled" for rid in busy)


def test_api_cancel_of_unknown_id_is_404(smol):
    r = httpx.post(f"{smol.url}/api/cancel", json={"id": "no-such-request"}, timeout=30)
    assert r.status_code == 404
    assert "no-such-request" in r.json()["error"]


def test_api_cancel_without_id_is_400(smol):
    r = httpx.post(f"{smol.url}/api/cancel", json={}, timeout=30)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_request_id_in_use_is_409(smol):
    _wait_idle(smol)
    body = {"model": smol.model, "prompt": LONG, "options": {"num_predict": 1000}}
    with httpx.stream("POST", f"{smol.url}/api/generate", json=body, headers={"X-Request-Id": "dup-1"},
                      timeout=120) as r:
        # keep the line iterator: once collected, httpx closes the connection and the server
        # rightly cancels the request, freeing its id
        lines = r.iter_lines()
        assert json.loads(next(lines))["done"] is False
        # the duplicate asks for one token, so that if it were wrongly admitted it would answer at once
        dup = httpx.post(f"{smol.url}/api/generate", headers={"X-Request-Id": "dup-1"}, timeout=60,
                         json={**body, "stream": False, "options": {"num_predict": 1}})
        assert dup.status_code == 409 and "dup-1" in dup.json()["error"], (dup.status_code, dup.text)
        httpx.post(f"{smol.url}/api/cancel", json={"id": "dup-1"}, timeout=30)
