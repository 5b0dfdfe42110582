"""The chat page in a real browser (Debian's Chromium driven by Playwright) against real `pagelm serve`
processes: streamed answers equal the API's, stop cancels on the server, images reach the tower,
conversations survive a reload, model and user HTML stay text, and the page keeps up with a long answer.

One browser for the module, a fresh context (empty storage) per test; the servers are the session's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import threading
import time
from itertools import pairwise
from pathlib import Path

import jsonschema
import pytest
from serve_helpers import API_KEY, REQUEST_S, png

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("PAGELM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# what this machine's closed network needs: no background connections, no sandbox as root, no GPU
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]
TIMEOUT_MS = REQUEST_S * 1000
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 740}
COLOR_SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}}, "required": ["color"],
                "additionalProperties": False}
# records [time, length] each time the last answer's text changes length in the DOM
WATCH_ANSWER = """() => { window.__steps = [];
    new MutationObserver(() => {
        const body = document.querySelector('#messages .msg.assistant:last-of-type .body');
        const n = body ? body.textContent.length : 0;
        if (n && n !== (window.__steps.at(-1) || [0, 0])[1]) window.__steps.push([performance.now(), n]);
    }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true}); }"""
XSS = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script>'
# window.fetch answers /v1/chat/completions with `pieces` of content, one an animation frame (the
# page's own played-back model); `ends` false cuts the stream before its finish and [DONE]
PLAY_BACK = """([pieces, ends]) => {
    const fetchFromServer = window.fetch;
    const encoder = new TextEncoder();
    const event = (data) => encoder.encode(`data: ${JSON.stringify(data)}\\n\\n`);
    window.fetch = (url, init) => {
        if (url !== "/v1/chat/completions") return fetchFromServer(url, init);
        const body = new ReadableStream({ async start(out) {
            for (const content of pieces) {
                out.enqueue(event({ choices: [{ index: 0, delta: { content } }] }));
                await new Promise((resolve) => requestAnimationFrame(resolve));
            }
            if (ends) {
                out.enqueue(event({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] }));
                out.enqueue(encoder.encode("data: [DONE]\\n\\n"));
            }
            out.close();
        } });
        return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
    };
}"""


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium (.ci/run does), or set PAGELM_CHROMIUM")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


class Tab:
    """One page in a fresh browser context, with the console errors it logged."""

    def __init__(self, browser, server, connects: bool = True, **context):
        self.server = server
        self.context = browser.new_context(**context)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.open(connects)

    def open(self, connects: bool = True) -> None:
        self.page.goto(f"{self.server.url}/")
        if connects:
            self.wait_connected()

    def wait_connected(self) -> None:
        self.page.wait_for_function("m => document.querySelector('#model-name').textContent === m",
                                    arg=self.server.model)

    def settings(self, **values) -> None:
        self.page.click("#open-settings")
        for key, value in values.items():
            self.page.fill(f"#set-{key}", str(value))
        self.page.click("#save-settings")

    def answered(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.answered || 0)"))

    def wait_answered(self, count: int) -> None:
        self.page.wait_for_function("n => Number(document.body.dataset.answered || 0) >= n", arg=count)

    def send(self, text: str) -> None:
        """Type `text`, press Enter, wait until the answer ended."""
        before = self.answered()
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")
        self.wait_answered(before + 1)

    def last(self, part: str = ".body") -> str:
        return self.page.locator(f"#messages .msg.assistant {part}").last.inner_text()

    def stored(self) -> list[dict]:
        """The conversations as the page keeps them in IndexedDB."""
        return self.page.evaluate("""() => new Promise((ok, fail) => {
            const open = indexedDB.open("pagelm");
            open.onsuccess = () => {
                const all = open.result.transaction("conversations").objectStore("conversations").getAll();
                all.onsuccess = () => ok(all.result);
                all.onerror = fail;
            };
            open.onerror = fail; })""")


@pytest.fixture
def tabs(browser):
    opened: list[Tab] = []

    def tab(server, connects: bool = True, **context) -> Tab:
        opened.append(Tab(browser, server, connects, **context))
        return opened[-1]

    yield tab
    for t in opened:
        t.context.close()


def branch_of(conversation: dict) -> list[dict]:
    nodes, path, at = conversation["nodes"], [], conversation["leaf"]
    while at:
        path.insert(0, nodes[at])
        at = nodes[at].get("parent")
    return path


def collapse(text: str) -> str:
    return " ".join(text.split())


def wait_ps(server, check, what: str, polls: int = 600) -> dict:
    """/api/ps once `check(ps)` holds, polled every 0.2 s at most `polls` times."""
    for _ in range(polls):
        ps = server.ps()
        if check(ps):
            return ps
        time.sleep(0.2)
    pytest.fail(f"/api/ps never showed {what}: {ps['requests']}")


def test_a_streamed_answer_equals_the_apis_and_shows_its_costs(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    tab.settings(temperature=0, max_tokens=40, top_p=0.9, seed=3)
    assert tab.page.locator("#think-switch").is_hidden()  # SmolLM2's template has no thinking switch
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    page.evaluate(WATCH_ANSWER)
    tab.send("Write three sentences about the sea.")
    growth = [length for _, length in page.evaluate("window.__steps")]
    assert len(growth) >= 4 and growth == sorted(growth), growth  # it grew in steps while it streamed

    (body,) = sent
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 40
    assert body["top_p"] == 0.9 and body["seed"] == 3 and "response_format" not in body
    with smol.client() as c:
        reply = c.post("/v1/chat/completions", json={**body, "stream": False}).json()
    answer = reply["choices"][0]["message"]["content"]
    (conversation,) = tab.stored()
    assert branch_of(conversation)[-1]["content"] == answer
    assert collapse(tab.last()) == collapse(answer)
    usage = reply["usage"]
    stats = tab.last(".stats")
    assert f"{usage['prompt_tokens']} prompt" in stats and f"{usage['completion_tokens']} completion" in stats
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", stats), stats

    page.wait_for_function("() => document.querySelector('[data-figure=served]').textContent !== '–'")
    ps = smol.ps()
    assert page.inner_text("[data-figure=file]") == ps["models"][0]["file"]
    assert page.inner_text("[data-figure=size]") == f"{ps['models'][0]['size'] / 2**20:.1f} MiB"
    assert page.inner_text("[data-figure=cancelled]") == str(ps["requests"]["cancelled"])
    assert re.fullmatch(r"[\d.]+ (MiB|GiB)", page.inner_text("[data-figure=file_rss]"))

    page.set_input_files("#attach", files=[{"name": "a.png", "mimeType": "image/png", "buffer": png(8, 8)}])
    assert "has no vision tower" in page.inner_text("#notice")
    assert page.locator("#attachments img").count() == 0
    assert tab.errors == []


def test_stop_cancels_the_request_on_the_server(tabs, smol):
    tab = tabs(smol)
    tab.settings(max_tokens=400)
    cancelled = smol.ps()["requests"]["cancelled"]
    before = tab.answered()
    tab.page.fill("#input", "Tell me a long story about a lighthouse keeper.")
    tab.page.press("#input", "Enter")
    tab.page.wait_for_function("() => (document.querySelector('#messages .msg.assistant .body') || {}).textContent")
    tab.page.keyboard.press("Escape")
    tab.wait_answered(before + 1)
    assert "(stopped)" in tab.last(".notes")
    wait_ps(smol, lambda ps: ps["requests"]["cancelled"] >= cancelled + 1 and not ps["requests"]["running"],
            "the request cancelled")
    (conversation,) = tab.stored()
    assert branch_of(conversation)[-1]["stopped"] is True
    assert tab.errors == []


def test_an_attached_image_reaches_the_tower(tabs, qwen_vision):
    tab = tabs(qwen_vision)
    page = tab.page
    passes = qwen_vision.ps()["image_cache"]["tower_passes"]
    assert page.locator("#think-switch").is_visible()  # Qwen3.5's template has one
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    page.set_input_files("#attach", files=[{"name": "a.png", "mimeType": "image/png", "buffer": png(40, 40, seed=21)}])
    for seed, (event, target) in enumerate((("paste", "#input"), ("drop", "#main")), 22):  # the other two ways in
        page.evaluate("""([event, target, bytes]) => {
            const data = new DataTransfer();
            data.items.add(new File([new Uint8Array(bytes)], "x.png", {type: "image/png"}));
            const init = {bubbles: true, cancelable: true};
            document.querySelector(target).dispatchEvent(event === "paste"
                ? new ClipboardEvent("paste", {...init, clipboardData: data})
                : new DragEvent("drop", {...init, dataTransfer: data}));
        }""", [event, target, list(png(40, 40, seed=seed))])
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 3")
    tab.send("What is in this picture?")
    assert not page.locator("#messages .msg.assistant .error").count(), tab.last()
    assert qwen_vision.ps()["image_cache"]["tower_passes"] == passes + 3
    assert page.locator("#messages .msg.user .images img").count() == 3
    (body,) = sent
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [p["type"] for p in body["messages"][-1]["content"]] == ["text", "image_url", "image_url", "image_url"]
    (conversation,) = tab.stored()
    assert branch_of(conversation)[0]["images"][0].startswith("data:image/png;base64,")
    assert tab.errors == []


def test_conversations_survive_a_reload_and_branch_on_edit(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    tab.settings(temperature=0, max_tokens=8)
    tab.send("Hello there")
    first_answer = tab.last()
    page.click("#new-chat")
    tab.settings(max_tokens=24, schema=json.dumps(COLOR_SCHEMA))  # for the next message only
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    tab.send("Name a color")
    second_answer = tab.last()
    jsonschema.validate(json.loads(second_answer), COLOR_SCHEMA)
    assert sent[0]["response_format"]["json_schema"]["schema"] == COLOR_SCHEMA
    assert page.locator("#schema-flag").is_hidden()

    tab.open()  # a reload
    assert page.locator("#chat-list li").count() == 2
    assert page.locator("#messages .msg.user .body").inner_text() == "Name a color"
    page.locator("#chat-list .title", has_text="Hello there").click()
    assert page.locator("#messages .msg.user .body").inner_text() == "Hello there"
    assert tab.last() == first_answer
    page.locator("#chat-list .title", has_text="Name a color").click()
    assert tab.last() == second_answer

    page.locator("#chat-list li.active .rename").click()
    page.fill("#chat-list input", "Colours")
    page.press("#chat-list input", "Enter")
    assert page.locator("#chat-list li.active .title").inner_text() == "Colours"

    before = tab.answered()
    page.locator("#messages .msg.user .edit").click()
    page.fill("#messages .edit-box textarea", "Name a fruit")
    page.click("#messages .save-edit")
    tab.wait_answered(before + 1)
    assert "response_format" not in sent[-1] and len(sent) == 2
    assert page.locator("#messages .msg.user .body").inner_text() == "Name a fruit"
    assert page.locator("#messages .msg.user .branch").inner_text() == "2/2"
    page.locator("#messages .msg.user .prev").click()
    assert page.locator("#messages .msg.user .body").inner_text() == "Name a color"
    assert tab.last() == second_answer

    before = tab.answered()
    page.locator("#messages .msg.assistant .regenerate").click()
    tab.wait_answered(before + 1)
    assert page.locator("#messages .msg.assistant .branch").inner_text() == "2/2"

    with page.expect_download() as download:
        page.click("#export-chats")
    exported = json.loads(Path(download.value.path()).read_text())
    titles = sorted(c["title"] for c in exported["conversations"])
    assert titles == ["Colours", "Hello there"]
    (colours,) = (c for c in exported["conversations"] if c["title"] == "Colours")
    assert len(colours["nodes"]) == 5  # two user versions, three answers

    page.locator("#chat-list li", has_text="Hello there").hover()
    page.locator("#chat-list li", has_text="Hello there").locator(".delete").click()
    assert page.locator("#chat-list li").count() == 2  # the first click only asks
    page.locator("#chat-list li", has_text="Hello there").locator(".delete").click()
    # the list drops it once IndexedDB's delete has committed; a reload before that could abort it
    page.wait_for_function("() => document.querySelectorAll('#chat-list li').length === 1")
    tab.open()
    assert page.locator("#chat-list .title").all_inner_texts() == ["Colours"]
    assert tab.errors == []


def test_html_from_the_model_or_the_user_renders_as_text(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": f"thinking {XSS}"}}]},
              {"choices": [{"index": 0, "delta": {"content": f"**Bold** {XSS}\n\n```python\nprint('hi')\n```\n"}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}}]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    # the model's answer is played back from here: a real model does not write this on request
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, body=stream, headers={"Content-Type": "text/event-stream", "X-Request-Id": "chatcmpl-test"}))
    tab.send(f"Is this safe? {XSS}")
    messages = page.locator("#messages")
    assert page.evaluate("window.__pwned") is None
    assert messages.locator("img, script").count() == 0
    assert XSS in page.locator("#messages .msg.user .body").inner_text()
    assert '<img src=x onerror="window.__pwned=1">' in tab.last()
    assert messages.locator(".msg.assistant .body strong").inner_text() == "Bold"
    assert f"thinking {XSS}" in page.locator("#messages .reasoning-text").text_content()
    assert page.locator("#messages details.reasoning").get_attribute("open") is None  # closed once it answered
    code = messages.locator(".msg.assistant pre code")
    assert "hljs" in code.get_attribute("class") and code.locator("span").count() > 0
    assert messages.locator(".msg.assistant pre .copy-code").count() == 1
    tab.open()  # and again when the stored conversation is rendered after a reload
    assert page.evaluate("window.__pwned") is None and messages.locator("img, script").count() == 0
    assert tab.errors == []


def test_the_page_keeps_up_with_a_500_token_answer(tabs, qwen_vision, capsys):
    """While 500 tokens stream: keystrokes typed meanwhile all land, a reader's scroll position is
    kept, and the answer reaches the DOM in many steps (the gaps between them are reported)."""
    tab = tabs(qwen_vision, viewport=PHONE)
    page = tab.page
    tab.settings(max_tokens=500, temperature=1, seed=7)
    page.evaluate(WATCH_ANSWER)
    before = tab.answered()
    page.fill("#input", "Say anything at all.")
    page.press("#input", "Enter")
    box = page.locator("#messages")
    page.wait_for_function("() => { const m = document.querySelector('#messages'); "
                           "return m.scrollHeight > m.clientHeight + 200; }")
    box.evaluate("m => { m.scrollTop = 0; }")  # the reader scrolls back up
    typed = "typed while it streams, every key of it"
    page.locator("#input").press_sequentially(typed)
    assert tab.answered() == before, "the answer ended before the typing did: nothing was measured"
    tab.wait_answered(before + 1)
    assert page.input_value("#input") == typed
    assert box.evaluate("m => m.scrollTop") == 0

    steps = page.evaluate("window.__steps")
    (conversation,) = tab.stored()
    completion = branch_of(conversation)[-1]["stats"]["completion_tokens"]
    gaps = [b[0] - a[0] for a, b in pairwise(steps)]
    with capsys.disabled():
        print(f"\nchat page, {completion} tokens streamed: {len(steps)} DOM updates, gap between updates "
              f"median {statistics.median(gaps):.1f} ms, 95th percentile {sorted(gaps)[int(len(gaps) * .95)]:.1f} ms, "
              f"max {max(gaps):.1f} ms")
    assert completion >= 400
    assert len(steps) >= 50, f"only {len(steps)} DOM updates for {completion} tokens"
    assert tab.errors == []


def test_screenshots_of_a_real_conversation(tabs, smol):
    """docs/ui-{desktop,phone}-{light,dark}.png: SmolLM2 answering, with the memory panel."""
    tab = tabs(smol, viewport=DESKTOP)
    page = tab.page
    tab.settings(temperature=0, max_tokens=80)
    tab.send("Write a Python function that returns the square of a number.")
    tab.send("Now make it return the cube.")  # a second turn: its prompt comes from the prefix cache
    assert not re.search(r" 0 cached", tab.last(".stats")), tab.last(".stats")
    page.wait_for_function("() => document.querySelector('[data-figure=slots]').textContent === '0 / 4'")
    shots = {}
    for theme in ("light", "dark"):
        page.emulate_media(color_scheme=theme)
        page.set_viewport_size(DESKTOP)
        shots[f"desktop-{theme}"] = page.screenshot()
        page.set_viewport_size(PHONE)
        if theme == "dark":
            page.click("#toggle-panel")  # the phone's view of the memory panel
        shots[f"phone-{theme}"] = page.screenshot()
    for name, data in shots.items():
        (ROOT / "docs" / f"ui-{name}.png").write_bytes(data)
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    assert page.locator("#panel").is_visible()
    assert tab.errors == []


def test_a_server_with_an_api_key_asks_for_it(tabs, strict):
    tab = tabs(strict, connects=False)
    tab.page.wait_for_function("() => document.querySelector('#model-name').textContent === 'API key needed'")
    assert "needs an API key" in tab.page.inner_text("#notice")
    tab.settings(key=API_KEY)
    tab.wait_connected()
    assert tab.page.is_hidden("#notice")
    tab.page.wait_for_function("() => document.querySelector('[data-figure=served]').textContent !== '–'")
    # a 401 logs the failed fetch as a console error: the only ones allowed here
    assert all("401" in e for e in tab.errors), tab.errors


def test_the_panel_shows_busy_and_total_slots(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    total = smol.ps()["slots"]["total"]
    assert total >= 2
    page.wait_for_function("t => document.querySelector('[data-figure=slots]').textContent === `0 / ${t}`", arg=total)
    ids = ["ui-slots-1", "ui-slots-2"]

    def ask(rid: str) -> None:  # long answers (greedy counting goes on), cancelled once the page showed both
        with smol.client() as c:
            c.post("/v1/completions", headers={"X-Request-Id": rid},
                   json={"model": smol.model, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0})

    asking = [threading.Thread(target=ask, args=(rid,)) for rid in ids]
    for thread in asking:
        thread.start()
    try:
        page.wait_for_function("t => document.querySelector('[data-figure=slots]').textContent === `2 / ${t}`",
                               arg=total)
    finally:
        with smol.client() as c:
            for rid in ids:
                c.post("/api/cancel", json={"id": rid})
        for thread in asking:
            thread.join()
    assert page.inner_text("[data-figure=queued]") == "0"
    assert tab.errors == []


def test_a_conversation_deleted_while_it_streams_stays_deleted(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    tab.settings(max_tokens=400)
    tab.send("Hello")  # a second conversation to fall back on
    page.click("#new-chat")
    before = tab.answered()
    page.fill("#input", "Tell me a long story about a lighthouse keeper.")
    page.press("#input", "Enter")
    page.wait_for_function("() => (document.querySelector('#messages .msg.assistant .body') || {}).textContent")
    doomed = page.locator("#chat-list li.active")
    doomed.hover()
    doomed.locator(".delete").click()
    doomed.locator(".delete").click()
    tab.wait_answered(before + 1)  # the stream ended (stopped) after the delete
    page.wait_for_function("() => document.querySelectorAll('#chat-list li').length === 1")
    tab.open()  # a reload
    assert page.locator("#chat-list .title").all_inner_texts() == ["Hello"]
    assert [c["title"] for c in tab.stored()] == ["Hello"]
    assert tab.errors == []


def test_importing_an_empty_export_says_so_and_send_still_works(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    tab.settings(max_tokens=4)
    empty = json.dumps({"pagelm": 1, "conversations": []}).encode()
    page.set_input_files("#import-chats", files=[{"name": "empty.json", "mimeType": "application/json",
                                                  "buffer": empty}])
    # the import reads the file asynchronously: wait for its notice rather than read it at once
    page.wait_for_function("() => document.querySelector('#notice').innerText.includes('holds no conversations')")
    assert "empty.json: it holds no conversations" in page.inner_text("#notice")
    tab.send("Hello")
    assert page.locator("#messages .msg.assistant").count() == 1 and tab.last()
    assert tab.errors == []


def test_settings_the_form_marks_invalid_are_not_saved(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    tab.settings(temperature=0.5)
    tab.settings(temperature=5, max_tokens=8)  # the field allows 0 to 2
    assert page.locator("#settings").get_attribute("open") is not None  # the dialog stays open
    page.click("#settings button[value=cancel]")
    assert json.loads(page.evaluate("localStorage.getItem('pagelm.settings')"))["temperature"] == "0.5"
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    tab.send("Hello")
    assert sent[0]["temperature"] == 0.5 and "max_tokens" not in sent[0]
    assert tab.errors == []


def test_a_stream_cut_before_done_shows_as_interrupted(tabs, smol):
    tab = tabs(smol)
    page = tab.page
    page.evaluate(PLAY_BACK, [["The answer ", "stops he"], False])
    tab.send("Hello")
    assert tab.last() == "The answer stops he"
    assert "interrupted" in tab.last(".notes")
    (conversation,) = tab.stored()
    assert branch_of(conversation)[-1]["interrupted"] is True
    tab.open()  # the stored answer says so too
    assert "interrupted" in tab.last(".notes")
    assert tab.errors == []


def test_a_streamed_answer_renders_only_its_changing_end(tabs, smol):
    """Blocks already shown keep their DOM nodes while later ones stream; code is highlighted once complete."""
    tab = tabs(smol)
    page = tab.page
    code = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(8))
    text = f"First **paragraph**.\n\n```python\n{code}```\n\nLast words."
    pieces = [text[i:i + 6] for i in range(0, len(text), 6)]
    page.evaluate(PLAY_BACK, [pieces, True])
    page.evaluate("""() => new MutationObserver(() => {  // the paragraph and code as shown mid-code
        const body = document.querySelector('#messages .msg.assistant .body');
        if (body && !window.__paragraph && (body.querySelector('code') || {}).textContent?.includes('f2')) {
            window.__paragraph = body.querySelector('p');
            window.__codeHighlighted = body.querySelectorAll('.hljs').length;
        }
    }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true})""")
    tab.send("Write code")
    body = page.locator("#messages .msg.assistant .body")
    assert collapse(body.inner_text()).startswith("First paragraph. def f0(x):")
    assert page.evaluate("window.__paragraph.isConnected && window.__paragraph.textContent") == "First paragraph."
    assert page.evaluate("window.__codeHighlighted") == 0  # plain text while it was being written
    assert body.locator("pre code.hljs span").count() > 0 and body.locator(".copy-code").count() == 1
    assert body.locator("pre").count() == 1 and body.locator("p").last.inner_text() == "Last words."
    assert tab.errors == []


def test_a_conversation_past_the_context_says_so_and_starts_over(tabs, strict):
    """The strict server's context is 64 tokens: a second turn no longer fits, the same message alone does."""
    tab = tabs(strict, connects=False)
    page = tab.page
    tab.settings(key=API_KEY, temperature=0, max_tokens=12)
    tab.wait_connected()
    tab.send("Hi")
    question = "Now tell me, in one short sentence, what the sea looks like at dawn."
    tab.send(question)
    assert "context" in tab.last(".notes .error")
    page.click("#messages .context-hint .carry-over")
    page.wait_for_function("q => document.querySelector('#input').value === q", arg=question)
    assert page.locator("#chat-list li").count() == 2 and page.locator("#messages .msg").count() == 0
    before = tab.answered()
    page.press("#input", "Enter")
    tab.wait_answered(before + 1)
    assert page.locator("#messages .msg.assistant .error").count() == 0 and tab.last()
    # the browser logs the failed fetches: before the key was given, and the one past the context
    assert all("401" in e or "400" in e for e in tab.errors), tab.errors
