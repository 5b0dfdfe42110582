"""Several requests at once (`pagelm serve --parallel N`): each answer byte for byte the one the
request gets alone (both APIs, streamed or not, a forced tool call, a JSON schema, an image),
cancel and disconnect of one leave the others unchanged and free its slot, a full queue answers
503 with Retry-After while the earlier requests complete, and a bounded loop of mixed requests at
concurrency 8 loses none, duplicates none and keeps anonymous memory bounded."""

import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import b64, ndjson, png, sse

MIB = 1 << 20
NO_THINK = {"enable_thinking": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                   "required": ["city", "days"]}}}]
LONG = "Write a very long story about a dragon who lives in a castle."


@pytest.fixture(scope="module")
def pair(servers, smollm2_gguf):
    """Two slots and a queue of one: the third request waits, the fourth is refused."""
    return servers.get("parallel2", smollm2_gguf, "--ctx-len", "2048", "--max-tokens", "64", "--parallel", "2",
                       "--queue-size", "1")


def _wait(server, done, what: str, deadline_s: float = 600) -> dict:
    end = time.monotonic() + deadline_s
    while not done(ps := server.ps()):
        assert time.monotonic() < end, f"{what}: {json.dumps(ps['requests'])} {json.dumps(ps['slots'])}"
        time.sleep(0.02)
    return ps


def _idle(ps: dict) -> bool:
    """Nothing left to do: no request, the answers kept, the heap trimmed."""
    return not ps["slots"]["working"]


# -- eight different requests at once -------------------------------------------------------

def _eight(nonce: str) -> list[tuple[str, dict]]:
    """(route, body) of eight different requests; `nonce` makes their prompts new to the cache."""
    system = {"role": "system", "content": f"Session {nonce}."}

    def user(text):
        return [system, {"role": "user", "content": text}]

    picture = [system, {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png(64, 48, seed=3))}"}}]}]
    essay = " ".join(f"Paragraph {i} is about rivers, owls, clocks and bread." for i in range(40))
    return [
        ("/v1/chat/completions", {"messages": user("Hello there."), "max_tokens": 24, "temperature": 0,
                                  "chat_template_kwargs": NO_THINK}),
        ("/v1/chat/completions", {"messages": user(f"Summarise: {essay}"), "max_tokens": 16, "temperature": 0,
                                  "stream": True, "chat_template_kwargs": NO_THINK}),
        ("/api/chat", {"messages": user("Tell me a joke."), "stream": False, "think": False,
                       "options": {"num_predict": 20, "temperature": 0.8, "seed": 7}}),
        ("/api/generate", {"prompt": f"{nonce} Once upon a time", "raw": True,
                           "options": {"num_predict": 12, "temperature": 0}}),
        ("/v1/chat/completions", {"messages": user("What will the weather be in Paris for three days?"),
                                  "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False,
                                  "max_tokens": 120, "temperature": 0, "chat_template_kwargs": NO_THINK}),
        ("/v1/chat/completions", {"messages": user("Give a name and an age."), "max_tokens": 80, "temperature": 0,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": PERSON}},
                                  "chat_template_kwargs": NO_THINK}),
        ("/v1/chat/completions", {"messages": picture, "max_tokens": 8, "temperature": 0,
                                  "chat_template_kwargs": NO_THINK}),
        ("/api/chat", {"messages": user("Describe a person."), "format": PERSON, "think": False,
                       "options": {"num_predict": 60, "temperature": 0}}),
    ]


def _answer(server, route: str, body: dict) -> dict:
    """What the client sees of an answer, less ids and timings: text, tool calls, finish, counts."""
    body = {"model": server.model, **body}
    streamed = body.get("stream", route.startswith("/api/"))
    with server.client() as c:
        if not streamed:
            r = c.post(route, json=body)
            assert r.status_code == 200, r.text
            reply = r.json()
            if route.startswith("/v1"):
                choice = reply["choices"][0]
                calls = [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"].get("tool_calls") or []]
                return {"content": choice["message"]["content"], "calls": calls, "finish": choice["finish_reason"],
                        "tokens": reply["usage"]["completion_tokens"]}
            return {"content": reply["message"]["content"] if "message" in reply else reply["response"],
                    "finish": reply["done_reason"], "tokens": reply["eval_count"]}
        with c.stream("POST", route, json=body) as r:
            assert r.status_code == 200, r.read()
            if route.startswith("/v1"):
                chunks, done = sse(r)
                assert done
                return {"content": "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks
                                           if ch["choices"]),
                        "finish": next(ch["choices"][0]["finish_reason"] for ch in reversed(chunks)
                                       if ch["choices"] and ch["choices"][0]["finish_reason"])}
            records = ndjson(r)
    assert records[-1]["done"] is True
    text = "".join(rec["message"]["content"] if "message" in rec else rec["response"] for rec in records)
    return {"content": text, "finish": records[-1]["done_reason"], "tokens": records[-1]["eval_count"]}


def test_eight_different_requests_at_once_answer_as_each_does_alone(qwen_vision):
    requests = _eight(uuid.uuid4().hex[:8])
    # together first, on prompts the cache has never seen: their prefills run beside the others' decodes
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda rb: _answer(qwen_vision, *rb), requests))
    ps = qwen_vision.ps()
    assert ps["histograms"]["batch_size"]["buckets"][0][1] < ps["histograms"]["batch_size"]["count"]  # some > 1
    alone = [_answer(qwen_vision, route, body) for route, body in requests]
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"request {i} ({requests[i][0]}) differs under load:\nalone    {a}\ntogether {t}"
    assert together[4]["calls"] and together[4]["finish"] in ("tool_calls", "length")
    assert len({a["content"] for a in alone}) > 4  # the answers really differ


# -- cancel and disconnect among four ---------------------------------------------------------

def _story(server, i: int) -> dict:
    return _answer(server, "/api/generate", {"prompt": f"Story {i}: {LONG}", "stream": False,
                                             "options": {"num_predict": 24 + 4 * i, "temperature": 0}})


@pytest.mark.parametrize("how", ["disconnect", "api-cancel"])
def test_cancelling_one_of_four_running_leaves_the_others_unchanged(smol, how):
    _wait(smol, _idle, "not idle")
    alone = [_story(smol, i) for i in range(3)]
    cancelled = smol.ps()["requests"]["cancelled"]
    rid = f"victim-{uuid.uuid4().hex[:8]}"
    body = {"model": smol.model, "prompt": LONG, "options": {"num_predict": 1000}}
    with ThreadPoolExecutor(3) as pool, httpx.stream("POST", f"{smol.url}/api/generate", json=body, timeout=300,
                                                     headers={"X-Request-Id": rid}) as victim:
        others = [pool.submit(_story, smol, i) for i in range(3)]
        lines = victim.iter_lines()
        assert json.loads(next(lines))["done"] is False
        if how == "api-cancel":
            assert httpx.post(f"{smol.url}/api/cancel", json={"id": rid}, timeout=30).status_code == 200
            rest = [json.loads(line) for line in lines if line.strip()]
            assert rest[-1]["done_reason"] == "cancelled" and rest[-1]["eval_count"] < 1000
        else:
            victim.close()
        # the freed slot takes a new request while the others may still run
        reused = pool.submit(_story, smol, 3)
        together = [f.result() for f in others]
        after = reused.result()
    assert together == alone
    assert after == _story(smol, 3)
    ps = _wait(smol, lambda ps: _idle(ps) and ps["requests"]["cancelled"] >= cancelled + 1, "not cancelled")
    assert ps["requests"]["cancelled"] == cancelled + 1
    assert ps["slots"]["busy"] == 0 and ps["slots"]["idle"] == ps["slots"]["total"] == 4


@pytest.fixture(scope="module")
def single(servers, smollm2_gguf):
    return servers.get("parallel1", smollm2_gguf, "--ctx-len", "2048", "--max-tokens", "64", "--parallel", "1")


def test_parallel_one_answers_one_request_at_a_time(single):
    alone = [_story(single, i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda i: _story(single, i), range(3)))
    assert together == alone
    ps = _wait(single, _idle, "not idle")
    batches = ps["histograms"]["batch_size"]
    assert batches["count"] > 0 and batches["buckets"][0] == [1, batches["count"]]  # every step one sequence
    assert ps["slots"]["total"] == 1 and ps["slots"]["per_slot_state_bytes"][0] > 0


# -- the queue ----------------------------------------------------------------------------

def test_full_queue_refuses_with_503_and_retry_after_while_the_earlier_ones_complete(pair):
    _wait(pair, _idle, "not idle")
    long_body = {"model": pair.model, "prompt": LONG, "stream": False, "options": {"num_predict": 400}}
    short = {"prompt": "Once upon a time", "stream": False, "options": {"num_predict": 8, "temperature": 0}}
    alone = _answer(pair, "/api/generate", short)
    results: dict[str, httpx.Response] = {}

    def post(name, body):
        results[name] = httpx.post(f"{pair.url}/api/generate", json=body, timeout=600)

    runners = [threading.Thread(target=post, args=(f"long-{i}", long_body)) for i in range(2)]
    for t in runners:
        t.start()
    _wait(pair, lambda ps: ps["slots"]["busy"] == 2, "the two slots were not taken")
    waiting = threading.Thread(target=post, args=("queued", {"model": pair.model, **short}))
    waiting.start()
    _wait(pair, lambda ps: ps["requests"]["queued"] == 1, "the third request did not wait")
    refused = httpx.post(f"{pair.url}/v1/completions", timeout=60,
                         json={"model": pair.model, "prompt": "Hi", "max_tokens": 2})
    refused_ollama = httpx.post(f"{pair.url}/api/generate", timeout=60,
                                json={"model": pair.model, "prompt": "Hi", "stream": False})
    for t in [*runners, waiting]:
        t.join()
    assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["type"] == "server_overloaded" and "queue is full" in refused.json()["error"]["message"]
    assert refused_ollama.status_code == 503 and "Retry-After" in refused_ollama.headers
    assert isinstance(refused_ollama.json()["error"], str)
    for i in range(2):
        reply = results[f"long-{i}"]
        assert reply.status_code == 200 and reply.json()["done_reason"] in ("stop", "length"), reply.text
    assert results["long-0"].json()["response"] == results["long-1"].json()["response"]
    queued = results["queued"].json()
    assert {"content": queued["response"], "finish": queued["done_reason"], "tokens": queued["eval_count"]} == alone


# -- a bounded loop ----------------------------------------------------------------------------

TOPICS = ["cats", "dogs", "the sea", "mountains", "rain", "bread", "music", "trains", "bees", "winter"]
# requests in the loop: 100 fit a slow shared 2-core machine; PAGELM_SERVE_LOOP=500 runs the 500
LOOP = int(os.environ.get("PAGELM_SERVE_LOOP", "100"))
WARM = min(50, LOOP // 4)  # requests before the memory reference is read


def _mixed(i: int) -> tuple[str, dict]:
    topic = TOPICS[i % len(TOPICS)]
    if i % 3 == 0:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"One line on {topic}."}],
                                        "max_tokens": 6, "temperature": 0, "stream": i % 2 == 0}
    if i % 3 == 1:
        return "/api/chat", {"messages": [{"role": "user", "content": f"Say something about {topic}."}],
                             "stream": i % 2 == 0, "options": {"num_predict": 6, "temperature": 0.7, "seed": i % 10}}
    return "/api/generate", {"prompt": f"{topic.title()} are", "stream": i % 2 == 0,
                             "options": {"num_predict": 6, "temperature": 0}}


def test_mixed_requests_at_concurrency_eight_lose_none_and_keep_memory_bounded(leaky):
    _wait(leaky, _idle, "not idle")
    # each distinct request alone (i and i + 30 are the same request)
    alone = {i: _answer(leaky, *_mixed(i)) for i in range(30)}
    served = leaky.ps()["requests"]["served"]
    seen: list[int] = []

    def run(i):
        answer = _answer(leaky, *_mixed(i))
        seen.append(i)
        return i, answer

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(run, range(WARM)))
        settled = _wait(leaky, _idle, "not idle")["memory"]["anonymous_bytes"]
        rest = list(pool.map(run, range(WARM, LOOP)))
    ps = _wait(leaky, _idle, "not idle")
    assert sorted(seen) == list(range(LOOP))  # each answered once
    assert ps["requests"]["served"] == served + LOOP and ps["requests"]["failed"] == 0
    for i, answer in first + rest:
        expected = alone[i % 30]
        assert answer["content"] == expected["content"] and answer["finish"] == expected["finish"], (i, answer)
    assert ps["slots"]["per_slot_state_bytes"][1:] == [0] * (ps["slots"]["total"] - 1)  # given back when idle
    grown = ps["memory"]["anonymous_bytes"] - settled
    assert grown <= 32 * MIB, f"anonymous memory grew {grown / MIB:.1f} MiB over {LOOP - WARM} requests"


# -- what the server reports ------------------------------------------------------------------

def test_ps_and_metrics_report_slots_queue_and_histograms(smol):
    _story(smol, 0)
    ps = _wait(smol, _idle, "not idle")
    slots = ps["slots"]
    assert slots["total"] == 4 and slots["busy"] + slots["idle"] == 4 and len(slots["per_slot_state_bytes"]) == 4
    assert slots["state_bytes"] == sum(slots["per_slot_state_bytes"]) == ps["memory"]["state_bytes"] > 0
    metrics = httpx.get(f"{smol.url}/metrics", timeout=30).text
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines())
    assert int(lines["pagelm_slots_total"]) == 4 and int(lines["pagelm_requests_queued"]) == 0
    for name in ("batch_size", "queue_wait_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = int(lines[f"pagelm_{name}_count"])
        assert count > 0 and int(lines[f'pagelm_{name}_bucket{{le="+Inf"}}']) == count, name
        assert float(lines[f"pagelm_{name}_sum"]) >= 0
    buckets = [int(v) for k, v in lines.items() if k.startswith("pagelm_batch_size_bucket")]
    assert buckets == sorted(buckets)  # cumulative
