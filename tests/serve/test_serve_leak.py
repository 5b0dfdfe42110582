"""The leak check: 200 requests mixing normal, cancelled and malformed ones leave the server
answering, with anonymous memory within 32 MiB of where it was after 50 of them."""

import json
import time

MIB = 1 << 20
TOPICS = ["cats", "dogs", "the sea", "mountains", "rain", "bread", "music", "trains", "bees", "winter"]


def _wait_idle(server, deadline_s=600):
    """Until the engine has nothing left to do: no request, the answers kept, the heap trimmed."""
    end = time.monotonic() + deadline_s
    while (ps := server.ps())["slots"]["working"]:
        assert time.monotonic() < end, ps
        time.sleep(0.05)
    return ps


def _normal_openai(client, server, i):
    r = client.post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % 10]} ({i})."}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _normal_ollama(client, server, i):
    r = client.post("/api/chat", json={
        "model": server.model, "stream": False, "options": {"num_predict": 4, "temperature": 0.7, "seed": i},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Hi #{i}"}]})
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True


def _disconnect(client, server, i):
    body = {"model": server.model, "prompt": f"Write about {TOPICS[i % 10]}.", "options": {"num_predict": 8}}
    with client.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())


def _cancel_by_id(client, server, i):
    rid = f"leak-{i}"
    body = {"model": server.model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": f"Count to ten ({i})."}]}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        cancel = client.post("/api/cancel", json={"id": rid})
        assert cancel.status_code in (200, 404)  # 404: it had already finished
        assert any(line == "data: [DONE]" for line in lines)


MALFORMED = [
    ("/v1/chat/completions", b'{"model": ', 400),
    ("/api/chat", b"[1, 2, 3]", 400),
    ("/v1/chat/completions", json.dumps({"model": "smollm2-135m", "messages": [], "temperature": "hot"}).encode(),
     400),
    ("/api/generate", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
    ("/v1/chat/completions", json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}).encode(), 400),
]


def _malformed(client, server, i):
    path, body, status = MALFORMED[i % len(MALFORMED)]
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text


KINDS = [_normal_openai, _disconnect, _malformed, _cancel_by_id, _normal_ollama]
WARM = 50


def test_mixed_requests_do_not_leak_anonymous_memory(leaky):
    """The baseline is taken after a warm-up of the same mix: by then the prefix cache has reached its
    bound and the slots a load's timing happens to take have been used once (what is left of them in
    the heap depends on that timing); a leak grows with every request after it."""
    with leaky.client() as client:
        for i in range(WARM):
            KINDS[i % len(KINDS)](client, leaky, i)
        first = _wait_idle(leaky)["memory"]["anonymous_bytes"]
        for i in range(WARM, WARM + 200):
            KINDS[i % len(KINDS)](client, leaky, i)
        after = _wait_idle(leaky)
        _normal_openai(client, leaky, 1000)
    stats = leaky.ps()
    growth = after["memory"]["anonymous_bytes"] - first
    print(f"\nleak check: anonymous after {WARM} warm-up requests {first / MIB:.1f} MiB, after 200 more "
          f"{after['memory']['anonymous_bytes'] / MIB:.1f} MiB (growth {growth / MIB:+.1f} MiB), "
          f"rss {after['memory']['rss_bytes'] / MIB:.1f} MiB, peak {after['memory']['peak_rss_bytes'] / MIB:.1f} MiB, "
          f"cache {after['prefix_cache']['bytes_held'] / MIB:.1f} MiB in {after['prefix_cache']['entries']} entries, "
          f"requests {stats['requests']}")
    assert stats["requests"]["cancelled"] >= 50
    assert stats["requests"]["failed"] == 0
    assert after["prefix_cache"]["bytes_held"] <= 8 * MIB
    assert growth <= 32 * MIB, f"anonymous memory grew by {growth / MIB:.1f} MiB"
