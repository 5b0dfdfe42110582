"""Limits of a server started with --queue-size 1 --max-body-mib 1 --ctx-len 64 --api-key."""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_helpers import API_KEY


def _completion(strict, max_tokens=40, headers=None):
    return httpx.post(f"{strict.url}/v1/completions", headers=strict.headers if headers is None else headers,
                      timeout=300, json={"model": strict.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                                         "temperature": 0})


def test_full_queue_answers_503_with_retry_after(strict):
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _completion(strict), range(6)))
    statuses = sorted(r.status_code for r in responses)
    # one runs, at most one waits: how many of the six got in depends on when the worker took the first
    assert 200 in statuses and 503 in statuses and set(statuses) == {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"].isdigit()
            error = r.json()["error"]
            assert "queue is full" in error["message"] and error["type"] == "server_overloaded"
    ok = [r.json()["choices"][0]["text"] for r in responses if r.status_code == 200]
    assert len(set(ok)) == 1  # every request that ran got the same greedy text
    assert _completion(strict, 4).status_code == 200


def test_full_queue_on_ollama_route_is_503_in_ollama_shape(strict):
    def generate(_):
        return httpx.post(f"{strict.url}/api/generate", headers=strict.headers, timeout=300,
                          json={"model": strict.model, "prompt": "Hi", "raw": True, "stream": False,
                                "options": {"num_predict": 40}})

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(generate, range(6)))
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(isinstance(r.json()["error"], str) and "Retry-After" in r.headers for r in refused)


def test_body_over_the_limit_is_413(strict):
    big = {"model": strict.model, "prompt": "x" * (1 << 20), "max_tokens": 1}
    r = httpx.post(f"{strict.url}/v1/completions", json=big, headers=strict.headers, timeout=60)
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]
    r = httpx.post(f"{strict.url}/api/generate", json=big, headers=strict.headers, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]


def test_chunked_body_over_the_limit_is_413(strict):
    """Without a Content-Length the server must still stop reading at the limit."""
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(24):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(f"{strict.url}/v1/completions", content=chunks(), timeout=60,
                   headers={**strict.headers, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert _completion(strict, 2).status_code == 200


def test_body_just_under_the_limit_is_read(strict):
    r = httpx.post(f"{strict.url}/v1/completions", headers=strict.headers, timeout=60,
                   json={"model": strict.model, "prompt": "Hi", "max_tokens": 1, "padding": "p" * 1_000_000})
    assert r.status_code == 200


def test_prompt_longer_than_the_context_is_400_naming_both_lengths(strict):
    r = httpx.post(f"{strict.url}/v1/chat/completions", headers=strict.headers, timeout=60,
                   json={"model": strict.model, "messages": [{"role": "user", "content": "word " * 200}]})
    assert r.status_code == 400
    error = r.json()["error"]
    m = re.search(r"(\d+) tokens long but the context is (\d+) tokens", error["message"])
    assert m and int(m.group(1)) > 200 and int(m.group(2)) == 64, error
    assert error["code"] == "context_length_exceeded"
    r = httpx.post(f"{strict.url}/api/generate", headers=strict.headers, timeout=60,
                   json={"model": strict.model, "prompt": "word " * 200, "stream": False})
    assert r.status_code == 400 and re.search(r"\d+ tokens long but the context is 64 tokens", r.json()["error"])


def test_answer_stops_at_the_context_end(strict):
    r = _completion(strict, max_tokens=1000)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= 64 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_missing_or_wrong_api_key_is_401(strict):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"X-Api-Key": "wrong"}):
        r = _completion(strict, 1, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{strict.url}/api/tags", timeout=30)
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    assert httpx.get(f"{strict.url}/metrics", timeout=30).status_code == 401


def test_right_api_key_is_accepted_either_way_and_health_needs_none(strict):
    assert _completion(strict, 1, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert _completion(strict, 1, headers={"X-Api-Key": API_KEY}).status_code == 200
    assert httpx.get(f"{strict.url}/api/tags", headers={"X-Api-Key": API_KEY}, timeout=30).status_code == 200
    assert httpx.get(f"{strict.url}/health", timeout=30).status_code == 200


def test_openai_client_with_wrong_key_raises_authentication_error(strict):
    import openai

    client = openai.OpenAI(base_url=f"{strict.url}/v1", api_key="wrong", max_retries=0, timeout=60)
    try:
        client.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    else:
        raise AssertionError("expected 401")
    assert [m.id for m in strict.openai().models.list()] == [strict.model]
