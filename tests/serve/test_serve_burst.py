"""Many clients at once: every request is answered, each with the answer it gets alone."""

from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_helpers import ndjson

TOPICS = ["cats", "dogs", "the sea", "mountains", "rain", "bread", "music", "trains", "bees", "winter",
          "the moon", "chess", "coffee", "rivers", "birds", "books", "gardens", "clocks", "bridges", "snow"]


def ask(server, i: int) -> tuple[int, str]:
    """Alternate protocols: /v1/chat/completions, /api/generate, and /api/chat streamed as NDJSON."""
    question = f"Write one sentence about {TOPICS[i]}."
    if i % 3 == 2:
        body = {"model": server.model, "messages": [{"role": "user", "content": question}],
                "options": {"num_predict": 8}}
        with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=300) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            records = ndjson(r)
        assert records[-1]["done"] is True
        return r.status_code, "".join(record["message"]["content"] for record in records)
    if i % 3 == 0:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"model": server.model, "messages": [{"role": "user", "content": question}],
                             "max_tokens": 8, "temperature": 0})
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
    r = httpx.post(f"{server.url}/api/generate", timeout=300,
                   json={"model": server.model, "prompt": question, "stream": False, "options": {"num_predict": 8}})
    return r.status_code, r.json()["response"] if r.status_code == 200 else r.text


def test_twenty_concurrent_requests_get_their_own_greedy_answers(smol):
    alone = [ask(smol, i) for i in range(len(TOPICS))]
    assert all(status == 200 and text for status, text in alone)
    assert len({text for _, text in alone}) > len(TOPICS) // 2  # the answers really differ
    served = smol.ps()["requests"]["served"]
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda i: ask(smol, i), range(len(TOPICS))))
    assert together == alone
    assert smol.ps()["requests"]["served"] == served + len(TOPICS)
