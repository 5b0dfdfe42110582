"""Pages of other sites and DNS-rebinding names get 403 from a real `pagelm serve` on loopback;
the server's own pages, loopback origins, clients without an Origin and the names and origins a
server is started with pass; a POST body must be declared JSON."""

import json

import httpx
import pytest

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
FOREIGN = "http://evil.example"


def _post(server, path="/v1/chat/completions", body=None, **headers) -> httpx.Response:
    content = json.dumps(CHAT if body is None else body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=120,
                      headers={"Content-Type": "application/json", **server.headers, **headers})


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/json"])
def test_a_foreign_origin_is_refused_whatever_it_posts(smol, content_type):
    r = _post(smol, **{"Origin": FOREIGN, "Content-Type": content_type})
    assert r.status_code == 403, r.text
    assert FOREIGN in r.json()["error"]["message"] and "--allowed-origin" in r.json()["error"]["message"]


def test_a_text_plain_post_without_origin_is_refused_as_not_json(smol):
    r = _post(smol, path="/api/chat", body={**CHAT, "stream": False}, **{"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = httpx.post(f"{smol.url}/api/chat", content=b"{}", timeout=60)  # no Content-Type at all
    assert r.status_code == 415


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "10.0.0.1"])
def test_a_foreign_host_is_refused_on_every_route(smol, host):
    for method, path in [("GET", "/api/ps"), ("GET", "/"), ("GET", "/health"), ("POST", "/v1/chat/completions")]:
        r = httpx.request(method, f"{smol.url}{path}", json=CHAT if method == "POST" else None,
                          headers={"Host": host}, timeout=60)
        assert r.status_code == 403, (path, r.text)
        assert "--allowed-host" in r.text and smol.model not in r.text


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST."])
def test_loopback_names_are_answered(smol, host):
    r = httpx.get(f"{smol.url}/v1/models", headers={"Host": f"{host}:{smol.port}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_servers_own_pages_and_loopback_origins_pass_with_cors_for_the_latter(smol):
    own = _post(smol, Origin=smol.url)
    assert own.status_code == 200, own.text
    local = "http://localhost:5173"  # a web app in development on the same machine
    r = _post(smol, Origin=local)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == local
    preflight = httpx.options(f"{smol.url}/v1/chat/completions", timeout=60, headers={
        "Origin": local, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == local
    foreign = httpx.options(f"{smol.url}/v1/chat/completions", timeout=60, headers={
        "Origin": FOREIGN, "Access-Control-Request-Method": "POST"})
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers


@pytest.mark.parametrize("origin", ["null", "chrome-extension://abcdef", "file://"])
def test_opaque_and_extension_origins_are_refused(smol, origin):
    assert _post(smol, Origin=origin).status_code == 403


def test_allowed_hosts_and_origins_pass(strict):
    """`strict` is started with --allowed-host pagelm.test --allowed-origin https://app.example."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert _post(strict, "/v1/completions", body, Host="pagelm.test").status_code == 200
    r = _post(strict, "/v1/completions", body, Origin="https://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert _post(strict, "/v1/completions", body, Host="other.test").status_code == 403
    assert _post(strict, "/v1/completions", body, Origin="https://app.example.evil").status_code == 403
