"""A model that chats in harmony (gpt-oss's real template and control tokens, tiny random layers)
behind a real server: a forced tool call and a JSON answer arrive after the analysis message, in the
OpenAI shape (the official client, streamed and not) and the Ollama shape (streamed), the analysis
as `reasoning_content` / `thinking`, and never a control token in either."""

import json

import jsonschema
import pytest

from serve_helpers import ndjson

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
          "additionalProperties": False}
BUDGET = {"reasoning_budget": 4}  # the random model never ends its analysis by itself
CONTROL = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|constrain|>")


def _clean(text: str) -> bool:
    return not any(token in text for token in CONTROL)


@pytest.mark.parametrize("seed", range(3))
def test_a_forced_call_arrives_after_the_analysis_streamed_as_whole(harmony_server, seed):
    client = harmony_server.openai()
    body = dict(model=harmony_server.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
                temperature=0.8, seed=seed, extra_body=BUDGET)
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    reasoning = (whole.message.model_extra or {}).get("reasoning_content")
    assert reasoning and _clean(reasoning) and not whole.message.content

    streamed, arguments, names = [], [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        streamed.append((delta.model_extra or {}).get("reasoning_content") or "")
        for c in delta.tool_calls or []:
            names += [c.function.name] if c.function.name else []
            arguments.append(c.function.arguments or "")
    assert "".join(streamed) == reasoning
    assert names == ["get_weather"] and "".join(arguments) == call.function.arguments


def test_a_json_answer_is_the_final_message_after_the_analysis(harmony_server):
    client = harmony_server.openai()
    r = client.chat.completions.create(
        model=harmony_server.model, messages=[{"role": "user", "content": "Pick a number."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER}},
        extra_body=BUDGET).choices[0].message
    jsonschema.validate(json.loads(r.content), NUMBER)
    reasoning = (r.model_extra or {}).get("reasoning_content")
    assert reasoning and _clean(reasoning) and _clean(r.content)


def test_ollama_streams_the_analysis_as_thinking_and_the_final_message_as_content(harmony_server):
    with harmony_server.client() as c, c.stream("POST", "/api/chat", json={
            "model": harmony_server.model, "messages": [{"role": "user", "content": "Pick a number."}],
            "format": NUMBER, "options": {"num_predict": 60, "temperature": 0, **BUDGET}}) as r:
        assert r.status_code == 200
        lines = ndjson(r)
    thinking = "".join(line["message"].get("thinking", "") for line in lines)
    content = "".join(line["message"]["content"] for line in lines)
    assert thinking and _clean(thinking) and lines[-1]["done"] is True
    jsonschema.validate(json.loads(content), NUMBER)


def test_a_call_and_its_result_fed_back_render_through_the_template(harmony_server):
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "18C", "tool_name": "get_weather"}]
    with harmony_server.client() as c:
        r = c.post("/api/chat", json={"model": harmony_server.model, "messages": messages, "tools": TOOLS,
                                      "stream": False, "options": {"num_predict": 40, "temperature": 0, **BUDGET}})
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True and _clean(r.json()["message"].get("thinking", ""))


def test_an_effort_is_taken_in_either_api_as_each_writes_it(harmony_server):
    usage = {}
    for effort in ("low", "high"):
        r = harmony_server.openai().chat.completions.create(
            model=harmony_server.model, messages=ASK, max_tokens=2, reasoning_effort=effort)
        usage[effort] = r.usage.prompt_tokens
        with harmony_server.client() as c:
            o = c.post("/api/chat", json={"model": harmony_server.model, "messages": ASK, "think": effort,
                                          "stream": False, "options": {"num_predict": 2}})
        assert o.status_code == 200, o.text
        assert o.json()["prompt_eval_count"] + o.json().get("prompt_cached_count", 0) == usage[effort]
    assert usage["low"] == usage["high"]  # the same text but for the effort (test_harmony checks the render)
