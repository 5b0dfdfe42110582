"""The chat page's files as the server sends them (no browser): a strict CSP, no inline
code and no address outside the server, hashed URLs cached for good, gzip and ETags, the page
weight bound, the vendored libraries at the versions the fetch script pins, and --no-ui."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from pagelm.serve import ui
from pagelm.serve.app import create_app
from pagelm.serve.core import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
PAGE_WEIGHT_LIMIT = 400 * 1024


def client(**settings) -> TestClient:
    """The app without its lifespan: nothing loads, the static routes answer."""
    return TestClient(create_app(ServeSettings(model_path="/nonexistent.gguf", model_name="none", **settings)),
                      base_url="http://127.0.0.1")  # a loopback name: the guard refuses others


@pytest.fixture(scope="module")
def page():
    c = client()
    response = c.get("/")
    assert response.status_code == 200
    return c, response


def referenced(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)


def test_the_policy_allows_only_the_servers_own_scripts_and_connections(page):
    _, response = page
    policy = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == "'self'" and policy["connect-src"] == "'self'" and policy["style-src"] == "'self'"
    assert "unsafe" not in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
    html = response.text
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "an inline script"
    assert not re.search(r"<style|\sstyle=|\son\w+=", html), "an inline style or event handler"


def test_page_files_name_no_address_outside_the_server():
    for name in ("index.html", "app.js", "style.css"):
        text = (ui.HERE / name).read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name


def test_hashed_assets_are_cached_for_good_and_the_page_revalidates(page):
    c, response = page
    assert response.headers["cache-control"] == "no-cache"
    names = referenced(response.text)
    assert {"/ui/app.js", "/ui/style.css", "/ui/vendor/marked.umd.js", "/ui/vendor/purify.min.js",
            "/ui/vendor/highlight.min.js"} <= {n.split("?")[0] for n in names}
    for name in names:
        asset = c.get(name)
        assert asset.status_code == 200, name
        assert asset.headers["cache-control"] == ui.FOREVER, name
        assert asset.content == (ui.HERE / name.split("?")[0].removeprefix("/ui/")).read_bytes()
    stale = c.get("/ui/app.js?v=0000")
    assert stale.status_code == 200 and stale.headers["cache-control"] == "no-cache"


def test_gzip_and_etags(page):
    c, response = page
    assert response.headers["content-encoding"] == "gzip"  # the test client asks for it
    plain = c.get("/ui/app.js", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers
    packed = c.get("/ui/app.js", headers={"accept-encoding": "gzip"})
    assert int(packed.headers["content-length"]) < len(plain.content)
    assert packed.content == plain.content  # httpx decompressed it
    again = c.get("/ui/app.js", headers={"if-none-match": plain.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


def test_page_weight_is_under_400_kb_compressed(page):
    c, response = page
    sizes = [int(c.get(name, headers={"accept-encoding": "gzip"}).headers["content-length"])
             for name in ["/"] + referenced(response.text)]
    assert sum(sizes) <= PAGE_WEIGHT_LIMIT, f"{sum(sizes)} bytes"


def test_vendored_libraries_match_the_pins_with_their_licenses():
    spec = importlib.util.spec_from_file_location("fetch_ui_vendor", ROOT / "scripts" / "fetch_ui_vendor.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    pinned = "".join(f"{package}@{version}\n" for package, version, _ in fetch.PINS)
    assert (ui.HERE / "vendor" / "VERSIONS").read_text() == pinned
    for package, version, files in fetch.PINS:
        for name in files.values():
            assert (ui.HERE / "vendor" / name).stat().st_size > 0, name
        assert any(name.startswith("LICENSE") for name in files.values()), package
    assert "marked v18.2.1" in (ui.HERE / "vendor" / "marked.umd.js").read_text()[:200]


def test_unknown_files_are_404_and_no_ui_serves_no_page():
    c = client()
    assert c.get("/ui/missing.js").status_code == 404
    assert c.get("/ui/__init__.py").status_code == 404
    bare = client(ui=False)
    response = bare.get("/")
    assert response.status_code == 404 and "no route GET /" in response.json()["error"]
    assert bare.get("/ui/app.js").status_code == 404


def test_the_cluster_ingress_serves_the_same_page():
    pytest.importorskip("ray.serve", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
    from pagelm.serve.cluster.deployments import ClusterServer

    def ingress(**settings) -> TestClient:
        s = ServeSettings(model_path="/nonexistent.gguf", model_name="none", **settings)
        return TestClient(create_app(s, server=ClusterServer(s, engine=None, replicas=1)), base_url="http://127.0.0.1")

    page = ingress().get("/")
    assert page.status_code == 200 and page.headers["content-security-policy"] == ui.CONTENT_SECURITY_POLICY
    assert page.text == client().get("/").text
    assert ingress(ui=False).get("/").status_code == 404


def test_pagelm_serve_no_ui_serves_the_api_without_the_page(servers, smollm2_gguf):
    server = servers.get("smol_no_ui", smollm2_gguf, "--no-ui", "--ctx-len", "512", "--max-tokens", "8")
    with server.client() as c:
        assert c.get("/").status_code == 404
        assert c.get("/ui/app.js").status_code == 404
        assert c.get("/v1/models").status_code == 200
