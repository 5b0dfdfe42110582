"""The chat page's cost of rendering one streamed 2,048-token code answer, in Chromium.

    PYTHONPATH=. .venv/bin/python bench/ui_render.py [--tokens N] [--per-frame K]

A real `pagelm serve` of SmolLM2-135M serves the page; the answer itself is played back inside the
page (its fetch of /v1/chat/completions answered from a stream that gives K tokens a frame), so
every run paints the same text in the same steps. Printed: the time spent in the page's
updateMessage (markdown, sanitizing, highlighting, DOM) summed over the answer, and Chromium's
script, style and layout time over the whole answer. The figures of another version of the page
come from running this with that version's tree on PYTHONPATH, from a directory outside any tree (the
server, started as `python -m pagelm`, imports from its working directory first and sends its own page).
"""

from __future__ import annotations

import argparse
import shutil

from playwright.sync_api import sync_playwright

from pagelm.bench.server import ServerConfig, ServerProcess
from pagelm.sources import store

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

# window.fetch answers /v1/chat/completions from `pieces`, `perFrame` of them each animation frame
PLAY_BACK = """([pieces, perFrame]) => {
    const fetchFromServer = window.fetch;
    const encoder = new TextEncoder();
    const event = (data) => encoder.encode(`data: ${JSON.stringify(data)}\\n\\n`);
    window.fetch = (url, init) => {
        if (url !== "/v1/chat/completions") return fetchFromServer(url, init);
        const body = new ReadableStream({ async start(out) {
            for (let i = 0; i < pieces.length; i += perFrame) {
                out.enqueue(event({ choices: [{ index: 0, delta: { content: pieces.slice(i, i + perFrame).join("") } }] }));
                await new Promise((resolve) => requestAnimationFrame(resolve));
            }
            out.enqueue(event({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] }));
            out.enqueue(encoder.encode("data: [DONE]\\n\\n"));
            out.close();
        } });
        return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
    };
    const update = window.updateMessage;
    window.renderMs = 0;
    window.updateMessage = (...args) => {
        const start = performance.now();
        update(...args);
        window.renderMs += performance.now() - start;
    };
}"""


def code_answer(tokens: int) -> list[str]:
    """A prose line, then one long Python block, about 4 characters a token, cut into `tokens` pieces."""
    functions = "".join(f'def square_sum_{i}(values):\n    """The sum of the squares, plus {i}."""\n'
                        f"    total = 0\n    for value in values:\n        total += value * value\n"
                        f"    return total + {i}\n\n" for i in range(tokens // 40))
    text = f"Here is the module you asked for:\n\n```python\n{functions}```\n\nEach function is independent.\n"
    return [text[len(text) * i // tokens:len(text) * (i + 1) // tokens] for i in range(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--per-frame", type=int, default=4)
    args = parser.parse_args()
    pieces = code_answer(args.tokens)
    with ServerProcess(str(store.pull("smollm2-135m")), ServerConfig(ctx_len=2048)) as server, \
            sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                             headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page()
        page.set_default_timeout(600_000)
        page.goto(f"http://127.0.0.1:{server.port}/")
        page.wait_for_function("() => !['connecting…', 'model loading…'].includes("
                               "document.querySelector('#model-name').textContent)")
        page.evaluate(PLAY_BACK, [pieces, args.per_frame])
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")

        def metrics() -> dict:
            return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}

        before = metrics()
        page.fill("#input", "Write the module.")
        page.press("#input", "Enter")
        page.wait_for_function("() => Number(document.body.dataset.answered || 0) >= 1")
        after = metrics()
        spent = {name: (after[name] - before[name]) * 1000
                 for name in ("ScriptDuration", "RecalcStyleDuration", "LayoutDuration")}
        print(f"{len(pieces)} pieces ({sum(map(len, pieces))} characters), {args.per_frame} a frame: "
              f"updateMessage {page.evaluate('window.renderMs'):.0f} ms; Chromium: script "
              f"{spent['ScriptDuration']:.0f} ms, style {spent['RecalcStyleDuration']:.0f} ms, "
              f"layout {spent['LayoutDuration']:.0f} ms")
        browser.close()


if __name__ == "__main__":
    main()
