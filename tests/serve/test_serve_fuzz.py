"""A seeded stream of malformed requests against a real `pagelm serve` on loopback, both APIs: each
valid request of every POST route mutated one to three times (fields swapped for other types, NaN
and Infinity, huge and deeply nested values, lone surrogates, unknown fields, fields dropped,
bodies cut or their bytes broken). Every answer is below 500, the log holds no traceback, the
server's anonymous memory grows by at most 32 MiB, and it answers a normal request after.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from serve_helpers import ServerProcess

from pagelm.measure.memory import read_memory

REQUESTS = 5000
WARMUP = 1000  # requests before the memory baseline: allocator pools and the grammar cache settle
MAX_GROWTH = 32 << 20
MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "adds",
                                          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"]}}}
BASES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                              "seed": 1, "stop": ["\n"], "stream": False,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": {"type": "object"}}}}),
    ("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}], "tools": [TOOL], "tool_choice": "auto"}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 2, "presence_penalty": 0.5,
                         "frequency_penalty": 0.5, "stream": False}),
    ("/api/chat", {"model": MODEL, "messages": HI, "stream": False, "format": {"type": "object"}, "think": False,
                   "options": {"num_predict": 2, "temperature": 0.7, "top_k": 5, "repeat_penalty": 1.1,
                               "num_ctx": 64, "stop": ["x"]}}),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "system": "Be brief.", "stream": True, "raw": False,
                       "images": [], "options": {"num_predict": 2, "seed": 3, "min_p": 0.1}}),
    ("/api/show", {"model": MODEL}),
    ("/api/cancel", {"id": "no-such-request"}),
]
RAW = "\x00raw{}\x00"  # a placeholder for JSON text json.dumps cannot write (huge integers, deep nesting)


def hostile_values(rng: random.Random) -> list:
    """Values a field might be given instead of its own; RAW.format(i) stands for raw JSON text."""
    return [None, True, False, 0, -1, 2**63, -(2**63) - 1, 1e308, -1e-308, float("nan"), float("inf"),
            float("-inf"), "", "x" * rng.choice([1, 1000, 100_000]), "\ud800", "\u0000", "\U0001F600" * 50, [],
            {}, [None], [1, "a", {}], {"a": [1, {"b": None}]}, {"type": [{}]}, {"required": [{}]},
            {"role": ["user"], "content": 1}, [{"role": "user", "content": "Hi"}] * rng.choice([1, 300]),
            "data:image/png;base64,iVBORw0KGgo=", RAW.format("huge-int"), RAW.format("deep"), RAW.format("deeper")]


RAW_TEXT = {"huge-int": "9" * 5000, "deep": "[" * 80 + "]" * 80, "deeper": "{\"a\":" * 50_000 + "1" + "}" * 50_000}


def places(value, path=()):
    """Every path into a body: keys of objects, indexes of lists."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from places(item, (*path, key))


def mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in places(body) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        key, kind = path[-1], rng.random()
        if kind < 0.7:
            parent[key] = rng.choice(hostile_values(rng))
        elif kind < 0.85:
            del parent[key]
        elif isinstance(parent, dict):
            parent[rng.choice(["unknown", "__proto__", "logit_bias", "n", "keep_alive"])] = rng.choice(
                hostile_values(rng))
    return body


def encode(rng: random.Random, body: dict) -> bytes:
    text = json.dumps(body)  # NaN and Infinity written as Python writes them
    for name, raw in RAW_TEXT.items():
        text = text.replace(json.dumps(RAW.format(name)), raw)
    data = text.encode("utf-8", "surrogatepass")
    kind = rng.random()
    if kind < 0.05:
        return data[: rng.randrange(len(data))]  # cut short
    if kind < 0.1:
        at = rng.randrange(len(data))
        return data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + data[at:]  # broken UTF-8
    return data


def malformed(seed: int):
    rng = random.Random(seed)
    for _ in range(REQUESTS):
        path, base = rng.choice(BASES)
        yield path, encode(rng, mutate(rng, base))


@pytest.fixture(scope="module")
def fuzzed(servers, smollm2_gguf) -> ServerProcess:
    """A server where any request that passes is short (a 96-token context, 2 tokens unless asked), and
    keeps nothing it is meant to keep (no prefix cache): what memory grows by is a leak."""
    return servers.get("fuzz", smollm2_gguf, "--ctx-len", "96", "--max-tokens", "2", "--parallel", "2",
                       "--prefix-slots", "0")


def test_malformed_requests_never_get_a_server_error(fuzzed):
    statuses: dict[int, int] = {}
    server_errors = []
    with httpx.Client(base_url=fuzzed.url, timeout=300, headers={"Content-Type": "application/json"}) as client:
        for i, (path, data) in enumerate(malformed(seed=52)):
            if i == WARMUP:
                baseline = read_memory(fuzzed.proc.pid).anonymous
            r = client.post(path, content=data)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                server_errors.append((path, data[:300], r.status_code, r.text[:300]))
        growth = read_memory(fuzzed.proc.pid).anonymous - baseline
        ok = client.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False})
    print(f"{REQUESTS} malformed requests: statuses {dict(sorted(statuses.items()))}, anonymous memory "
          f"{growth / 2**20:+.1f} MiB after the first {WARMUP}")  # the figures of docs/history.md (pytest -s)
    assert not server_errors, f"{len(server_errors)} answers >= 500, first: {server_errors[:3]}"
    assert sum(statuses.values()) == REQUESTS and statuses.get(400, 0) > REQUESTS // 2, statuses
    assert "Traceback" not in fuzzed.log(), fuzzed.log()[-3000:]
    assert growth <= MAX_GROWTH, f"anonymous memory grew {growth >> 20} MiB over {REQUESTS - WARMUP} requests"
    assert ok.status_code == 200 and ok.json()["done"] is True
