"""Tools and structured output through both APIs: forced calls that validate against the tool's
schema, full call → result → answer round trips, JSON answers that parse and validate, and every
malformed request refused in the protocol's error shape while the server keeps serving."""

import json

import jsonschema
import openai
import pytest

from serve_helpers import ndjson, sse

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                      "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                                                     "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
SEEDS = range(20)
# "any JSON object" bounds nothing, so a small model needs telling what to write (as Ollama's docs advise)
JSON_SYSTEM = {"role": "system",
               "content": 'You answer with one short JSON object, for example {"name": "Marie Curie", "age": 66}.'}
JSON_QUESTION = {"role": "user", "content": "Give the name and the age of a famous scientist."}


def check_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_choice_gives_a_valid_call_every_time(qwen, seed):
    r = qwen.openai().chat.completions.create(
        model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=0.8, seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("seed", range(4))
def test_parallel_calls_each_validate(qwen, seed):
    r = qwen.openai().chat.completions.create(
        model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0.8,
        seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
    for call in choice.message.tool_calls:
        check_call(call)


def test_streamed_tool_calls_assemble_to_the_non_streamed_ones(qwen):
    body = dict(model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    client = qwen.openai()
    whole = client.chat.completions.create(**body).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        for part in choice.delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_a_named_function_is_the_one_called(qwen):
    r = qwen.openai().chat.completions.create(
        model=qwen.model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    check_call(calls[0])


@pytest.mark.parametrize("seed", range(5))
def test_a_forced_call_arrives_from_a_model_that_never_stops_thinking(qwen, seed):
    """The random model never writes </think>: the budget closes the reasoning while the call has room."""
    r = qwen.openai().chat.completions.create(
        model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=0.8, seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_call(choice.message.tool_calls[0])
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and "<tool_call>" not in reasoning and "</think>" not in reasoning
    assert r.usage.completion_tokens <= 200


def test_a_reasoning_budget_bounds_the_thinking_before_a_json_answer(qwen):
    def thinking(budget: int) -> str:
        r = qwen.client().post("/api/chat", json={
            "model": qwen.model, "messages": [JSON_QUESTION], "stream": False, "think": True, "format": PERSON,
            "options": {"num_predict": 120, "temperature": 0, "reasoning_budget": budget}})
        assert r.status_code == 200, r.text
        message = r.json()["message"]
        jsonschema.validate(json.loads(message["content"]), PERSON)
        return message["thinking"]

    short, long = thinking(3), thinking(30)
    assert 0 < len(short) < len(long) and long.startswith(short)


def test_a_round_trip_through_the_openai_api(qwen):
    client = qwen.openai()
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    first = client.chat.completions.create(model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0, extra_body=extra).choices[0].message
    messages = ASK + [first.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"forecast": "sunny"})}
                 for c in first.tool_calls]
    answer = client.chat.completions.create(model=qwen.model, messages=messages, tools=TOOLS, max_tokens=24,
                                            temperature=0, extra_body=extra).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_a_round_trip_through_the_ollama_api(qwen):
    with qwen.client() as c:
        body = {"model": qwen.model, "messages": ASK, "tools": TOOLS, "stream": False, "think": False,
                "options": {"temperature": 0, "num_predict": 200}}
        r = c.post("/api/chat", json=body)
        assert r.status_code == 200, r.text
        # /api/chat has no tool_choice: the synthetic model rarely calls on its own, so feed a call back
        call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
        messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
        r = c.post("/api/chat", json={**body, "messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_answers_validate_on_qwen(qwen, seed):
    r = qwen.openai().chat.completions.create(
        model=qwen.model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=200,
        temperature=0.8, seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_answers_validate_on_smollm2(smol, seed):
    r = smol.openai().chat.completions.create(
        model=smol.model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=200,
        temperature=0.8, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("seed", SEEDS)
def test_ollama_format_json_answers_parse(smol, seed):
    with smol.client() as c:
        r = c.post("/api/chat", json={"model": smol.model, "format": "json", "stream": False,
                                      "messages": [JSON_SYSTEM, JSON_QUESTION],
                                      "options": {"temperature": 0.5, "seed": seed, "num_predict": 200}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["message"]["content"]), dict)


def test_ollama_format_schema_streams_and_validates(smol):
    with smol.client() as c:
        with c.stream("POST", "/api/generate", json={"model": smol.model, "prompt": "A person, as JSON.",
                                                     "format": PERSON, "options": {"num_predict": 200}}) as r:
            assert r.status_code == 200
            records = ndjson(r)
    jsonschema.validate(json.loads("".join(rec.get("response", "") for rec in records)), PERSON)


def test_openai_json_object_streams_and_parses(smol):
    with smol.client() as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": smol.model, "stream": True, "max_tokens": 200, "response_format": {"type": "json_object"},
                "temperature": 0.5, "seed": 0, "messages": [JSON_SYSTEM, JSON_QUESTION]}) as r:
            assert r.status_code == 200
            chunks, done = sse(r)
    assert done
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert isinstance(json.loads(text), dict)


# -- bad input: a 400 in each protocol's shape, and the server keeps serving ------------------

BAD_OPENAI = [
    ({"tools": "get_weather"}, "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a JSON schema of type object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be one of"),
    ({"tool_choice": "required"}, "offers no tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}}, "compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                         for i in range(1000)}}}}}, "limit"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]}, "matches no tool call"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "not valid JSON"),
]


@pytest.mark.parametrize("extra,message", BAD_OPENAI, ids=[m for _, m in BAD_OPENAI])
def test_bad_tool_and_format_requests_are_refused(qwen, extra, message):
    body = {"model": qwen.model, "messages": ASK, "max_tokens": 4, **extra}
    with qwen.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        assert c.post("/v1/chat/completions", json={"model": qwen.model, "messages": ASK,
                                                    "max_tokens": 2}).status_code == 200


def test_bad_ollama_format_is_refused_in_ollama_shape(qwen):
    with qwen.client() as c:
        r = c.post("/api/chat", json={"model": qwen.model, "messages": ASK, "format": 42, "stream": False})
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_a_model_without_tool_support_says_so(smol):
    with pytest.raises(openai.BadRequestError, match="cannot call tools"):
        smol.openai().chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, max_tokens=4)
    with smol.client() as c:
        r = c.post("/api/chat", json={"model": smol.model, "messages": ASK, "tools": TOOLS, "stream": False})
        assert r.status_code == 400 and "cannot call tools" in r.json()["error"]
        show = c.post("/api/show", json={"model": smol.model}).json()
    assert "tools" not in show["capabilities"]


def test_show_lists_tools_for_a_template_that_calls_them(qwen):
    with qwen.client() as c:
        assert "tools" in c.post("/api/show", json={"model": qwen.model}).json()["capabilities"]


def test_the_turn_after_a_call_prefills_only_the_tool_results(qwen):
    """The server keeps a call answer as the client sends it back (structured tool_calls), so the
    request carrying the results reuses it and prefills only them."""
    client = qwen.openai()
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    first = client.chat.completions.create(model=qwen.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0, seed=7,
                                           extra_body=extra)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model=qwen.model, messages=messages, tools=TOOLS, max_tokens=4,
                                            temperature=0, extra_body=extra)
    new = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    # <|im_start|>user \n <tool_response> \n sunny \n </tool_response> <|im_end|> \n + the generation prompt
    assert new <= 20, second.usage
