"""The Ollama routes through httpx: NDJSON streams, done records, options, think, model info routes."""

import re

import httpx
import pytest
from serve_helpers import ndjson

import pagelm

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Write a short story about a dragon."


def _post(server, path, body, timeout=120):
    return httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=timeout)


def _stream(server, path, body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={"model": server.model, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return ndjson(r)


def _check_done(record: dict, eval_count_max: int):
    assert record["done"] is True
    assert record["done_reason"] in ("stop", "length")
    assert 0 < record["eval_count"] <= eval_count_max
    # the prompt's tokens: computed, or restored (the same prompt again is all restored)
    assert record["prompt_eval_count"] >= 0 and record["prompt_eval_count"] + record["prompt_cached_count"] > 0
    for key in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(record[key], int) and record[key] > 0, key
    assert record["total_duration"] >= record["eval_duration"]
    assert record["total_duration"] >= record["prompt_eval_duration"]
    assert record["load_duration"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT.*Z", record["created_at"])


def test_chat_streams_ndjson_by_default_and_matches_stream_false(smol):
    records = _stream(smol, "/api/chat", {"messages": CAPITAL, "options": {"num_predict": 16}})
    assert all(r["done"] is False for r in records[:-1]) and len(records) > 2
    _check_done(records[-1], 16)
    streamed = "".join(r["message"]["content"] for r in records)
    assert "Paris" in streamed
    whole = _post(smol, "/api/chat", {"messages": CAPITAL, "stream": False, "options": {"num_predict": 16}})
    assert whole.status_code == 200
    body = whole.json()
    _check_done(body, 16)
    assert body["message"] == {"role": "assistant", "content": streamed}
    assert body["eval_count"] == records[-1]["eval_count"]
    assert body["done_reason"] == records[-1]["done_reason"] == "stop"


def test_generate_streams_ndjson_by_default_and_matches_stream_false(smol):
    records = _stream(smol, "/api/generate", {"prompt": STORY, "options": {"num_predict": 12}})
    assert all(r["done"] is False and "response" in r for r in records[:-1])
    _check_done(records[-1], 12)
    assert records[-1]["done_reason"] == "length" and records[-1]["eval_count"] == 12
    whole = _post(smol, "/api/generate", {"prompt": STORY, "stream": False, "options": {"num_predict": 12}}).json()
    _check_done(whole, 12)
    assert whole["response"] == "".join(r["response"] for r in records)


def test_generate_with_system_prompt_answers(smol):
    body = _post(smol, "/api/generate", {"prompt": "What is the capital of France?", "stream": False,
                                         "system": "You are a helpful assistant.",
                                         "options": {"num_predict": 16}}).json()
    assert "Paris" in body["response"]


def test_generate_raw_uses_no_template(smol):
    raw = _post(smol, "/api/generate", {"prompt": "The capital of France is", "raw": True, "stream": False,
                                        "options": {"num_predict": 4}}).json()
    templated = _post(smol, "/api/generate", {"prompt": "The capital of France is", "stream": False,
                                              "options": {"num_predict": 4}}).json()
    assert raw["prompt_eval_count"] + raw["prompt_cached_count"] < \
        templated["prompt_eval_count"] + templated["prompt_cached_count"]


def test_num_predict_limits_eval_count(smol):
    body = _post(smol, "/api/generate", {"prompt": STORY, "stream": False, "options": {"num_predict": 5}}).json()
    assert body["eval_count"] == 5 and body["done_reason"] == "length"


def test_same_seed_same_sample_and_seeds_differ(smol):
    def sample(seed):
        return _post(smol, "/api/generate", {"prompt": STORY, "stream": False,
                                             "options": {"num_predict": 16, "temperature": 1.0, "seed": seed}}
                     ).json()["response"]

    a = sample(1)
    assert sample(1) == a
    assert len({a, sample(2), sample(3)}) > 1


def test_temperature_zero_is_greedy(smol):
    def generate(options):
        return _post(smol, "/api/generate", {"prompt": STORY, "stream": False,
                                             "options": {"num_predict": 10, **options}}).json()["response"]

    assert generate({"temperature": 0}) == generate({"temperature": 0, "seed": 7}) == generate({"top_k": 1})


def test_stop_option_cuts_before_the_stop_string(smol):
    full = _post(smol, "/api/chat", {"messages": CAPITAL, "stream": False, "options": {"num_predict": 16}}).json()
    text = full["message"]["content"]
    assert "France" in text
    cut = _post(smol, "/api/chat", {"messages": CAPITAL, "stream": False,
                                    "options": {"num_predict": 16, "stop": ["France"]}}).json()
    assert cut["message"]["content"] == text[: text.index("France")]
    assert cut["done_reason"] == "stop"
    streamed = _stream(smol, "/api/chat", {"messages": CAPITAL, "options": {"num_predict": 16, "stop": "France"}})
    assert "".join(r["message"]["content"] for r in streamed) == cut["message"]["content"]


def test_num_ctx_bounds_prompt_plus_answer(smol):
    body = _post(smol, "/api/generate", {"prompt": STORY, "stream": False, "options": {"num_predict": 1}}).json()
    prompt_len = body["prompt_eval_count"] + body["prompt_cached_count"]
    short = _post(smol, "/api/generate", {"prompt": STORY, "stream": False,
                                          "options": {"num_predict": 50, "num_ctx": prompt_len + 3}}).json()
    assert short["eval_count"] == 3 and short["done_reason"] == "length"
    refused = _post(smol, "/api/generate", {"prompt": STORY, "stream": False, "options": {"num_ctx": prompt_len}})
    assert refused.status_code == 400
    assert f"{prompt_len} tokens" in refused.json()["error"]


# -- thinking on the synthetic Qwen3.5 -------------------------------------------------------

@pytest.mark.parametrize("think", [True, "high"])
def test_qwen_chat_think_fills_thinking_and_not_content(qwen, think):
    body = _post(qwen, "/api/chat", {"messages": CAPITAL, "stream": False, "think": think,
                                     "options": {"num_predict": 12}}).json()
    assert body["message"]["thinking"]
    assert body["message"]["content"] == ""


def test_qwen_chat_think_false_fills_content_only(qwen):
    body = _post(qwen, "/api/chat", {"messages": CAPITAL, "stream": False, "think": False,
                                     "options": {"num_predict": 12}}).json()
    assert body["message"]["content"]
    assert "thinking" not in body["message"]


def test_qwen_streamed_thinking_matches_stream_false(qwen):
    request = {"messages": CAPITAL, "think": True, "options": {"num_predict": 12}}
    records = _stream(qwen, "/api/chat", request)
    whole = _post(qwen, "/api/chat", {**request, "stream": False}).json()
    assert "".join(r["message"].get("thinking", "") for r in records) == whole["message"]["thinking"]


def test_qwen_generate_think_fills_thinking(qwen):
    on = _post(qwen, "/api/generate", {"prompt": "What is 2+2?", "stream": False, "think": True,
                                       "options": {"num_predict": 12}}).json()
    assert on["thinking"] and on["response"] == ""
    off = _post(qwen, "/api/generate", {"prompt": "What is 2+2?", "stream": False, "think": False,
                                        "options": {"num_predict": 12}}).json()
    assert off["response"] and "thinking" not in off


def test_bad_think_value_is_refused(qwen):
    r = _post(qwen, "/api/chat", {"messages": CAPITAL, "think": "very"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


# -- model information -----------------------------------------------------------------------

def test_tags_lists_the_model(smol, smollm2_gguf):
    body = httpx.get(f"{smol.url}/api/tags", timeout=30).json()
    [entry] = body["models"]
    assert entry["name"] == entry["model"] == "smollm2-135m"
    assert entry["size"] == __import__("os").path.getsize(smollm2_gguf)
    assert entry["details"]["format"] == "gguf" and entry["details"]["family"] == "llama"
    assert entry["modified_at"].endswith("Z")


def test_ps_reports_model_cache_requests_and_memory(smol):
    _post(smol, "/api/generate", {"prompt": "Hi", "stream": False, "options": {"num_predict": 1}})
    body = smol.ps()
    [entry] = body["models"]
    assert entry["name"] == "smollm2-135m" and entry["context_length"] == 2048
    assert set(body["prefix_cache"]) == {"enabled", "slots", "max_bytes", "entries", "bytes_held", "lookups",
                                         "hits", "tokens_reused", "evictions"}
    assert body["prefix_cache"]["enabled"] is True and body["prefix_cache"]["slots"] == 32
    assert body["prefix_cache"]["lookups"] >= 1
    assert set(body["requests"]) == {"served", "cancelled", "failed", "queued", "running"}
    assert body["requests"]["served"] >= 1
    memory = body["memory"]
    assert set(memory) == {"anonymous_bytes", "rss_bytes", "file_rss_bytes", "peak_rss_bytes",
                           "weights_anonymous_bytes", "tokenizer_anonymous_bytes", "state_bytes"}
    assert 0 < memory["anonymous_bytes"] < memory["rss_bytes"] <= memory["peak_rss_bytes"]
    # weights mapped (the default): norms and the prefill scratch tile, not the matrices
    assert 0 < memory["weights_anonymous_bytes"] <= 32 << 20
    assert 0 < memory["state_bytes"] < memory["anonymous_bytes"]


def test_metrics_mirror_ps(smol):
    text = httpx.get(f"{smol.url}/metrics", timeout=30).text
    assert re.search(r"^pagelm_requests_served \d+$", text, re.M)
    assert re.search(r"^pagelm_prefix_cache_hits \d+$", text, re.M)
    assert re.search(r"^pagelm_memory_anonymous_bytes \d+$", text, re.M)


def test_show_describes_model_and_capabilities(smol, qwen):
    body = httpx.post(f"{smol.url}/api/show", json={"model": "smollm2-135m"}, timeout=30).json()
    assert body["capabilities"] == ["completion"]
    assert body["model_info"]["general.architecture"] == "llama"
    assert "im_start" in body["template"]
    body = httpx.post(f"{qwen.url}/api/show", json={"name": qwen.model + ":latest"}, timeout=30).json()
    assert "thinking" in body["capabilities"]


def test_show_of_unknown_model_is_404(smol):
    r = httpx.post(f"{smol.url}/api/show", json={"model": "llama-9000"}, timeout=30)
    assert r.status_code == 404 and "llama-9000" in r.json()["error"]


def test_version(smol):
    assert httpx.get(f"{smol.url}/api/version", timeout=30).json() == {"version": pagelm.__version__}


def test_health_reports_the_model(smol):
    assert httpx.get(f"{smol.url}/health", timeout=30).json() == {"status": "ok", "model": "smollm2-135m"}
