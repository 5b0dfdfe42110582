"""Tool calls in the template's words: which form a template writes, reading calls back out of
streamed text (whatever the chunking), typing XML-form values by schema, and the forcing grammar."""

import json
from pathlib import Path

import llguidance
import pytest

from pagelm.chat.qwen35_template import QWEN35_TEMPLATE
from pagelm.chat.template import ChatTemplate
from pagelm.chat.tools import (MAX_STRING_CHARS, JsonFormat, Lfm2Format, QwenXmlFormat, Tool, ToolCall,
                               ToolCallStream, tool_format, typed_value)

WEATHER = Tool("get_weather", "Current weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                   "unit": {"type": "string", "enum": ["c", "f"]}, "where": {"type": "object"}},
    "required": ["city"]})
CLOCK = Tool("clock")

TEMPLATES = Path(__file__).parent / "templates"
QWEN25_TEMPLATE = (TEMPLATES / "qwen2.5.jinja").read_text()
LFM2_TEMPLATE = (TEMPLATES / "lfm2.jinja").read_text()
LFM25_TEMPLATE = (TEMPLATES / "lfm2.5.jinja").read_text()
# Qwen2.5's tool-call rendering (the JSON-in-<tool_call> form of Hermes-style templates), trimmed
HERMES_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content }}
    {%- for tool_call in message.tool_calls or [] %}
        {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
        {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
        {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def rendered_answer(template_source: str, calls: list[dict], content: str = "") -> str:
    """The assistant message as the template writes it, between its header and <|im_end|>."""
    text = ChatTemplate(template_source).render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": calls}],
        add_generation_prompt=False)
    answer = text.split("<|im_start|>assistant\n")[-1].split("</think>\n\n")[-1]
    return answer[: answer.index("<|im_end|>")].lstrip("\n")


CALLS = [{"type": "function", "function": {"name": "get_weather",
                                           "arguments": {"city": "Paris\nFrance", "days": 3, "metric": True,
                                                         "where": {"lat": 1.5}}}},
         {"type": "function", "function": {"name": "clock", "arguments": {}}}]


def test_forms_are_told_apart_by_the_template():
    assert isinstance(tool_format(QWEN35_TEMPLATE), QwenXmlFormat)
    assert isinstance(tool_format(HERMES_TEMPLATE), JsonFormat)
    assert type(tool_format(QWEN25_TEMPLATE)) is JsonFormat
    assert isinstance(tool_format(LFM2_TEMPLATE), Lfm2Format) and isinstance(tool_format(LFM25_TEMPLATE), Lfm2Format)
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


@pytest.mark.parametrize("source", [QWEN35_TEMPLATE, HERMES_TEMPLATE, QWEN25_TEMPLATE, LFM2_TEMPLATE],
                         ids=["qwen-xml", "json", "qwen2.5", "lfm2"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_calls_the_template_writes_are_read_back(source, chunk):
    text = rendered_answer(source, CALLS, content="Let me look.")
    stream = ToolCallStream(tool_format(source), [WEATHER, CLOCK])
    pieces = [p for i in range(0, len(text), chunk) for p in stream.push(text[i : i + chunk])] + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in CALLS]
    assert len({c.id for c in calls}) == 2


def test_text_that_is_not_a_call_is_kept():
    stream = ToolCallStream(QwenXmlFormat(), [WEATHER])
    text = "a < b and <tool_call>\n<function=unknown>\n</function>\n</tool_call> then <tool_ca"
    pieces = stream.push(text) + stream.finish()
    assert "".join(pieces) == text  # an unknown function and an unfinished tag come back as content


def test_xml_values_are_typed_by_schema():
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value("3", {"type": "string"}) == "3"
    assert typed_value("False", {"type": "boolean"}) is False  # how a Python template renders False
    assert typed_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed_value("3.5", {"type": "integer"}) == "3.5"  # not an integer: kept as written
    assert typed_value("null", {"type": ["string", "null"]}) is None
    assert typed_value("abc", {}) == "abc"


def byte_tokenizer() -> llguidance.LLTokenizer:
    """One token per byte plus an end token: enough to walk a grammar byte by byte."""

    class Bytes:
        tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

        def __call__(self, text):
            return list(text if isinstance(text, bytes) else text.encode())

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def accepts(grammar: str, text: str) -> bool:
    tokenizer = byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("source", [QWEN35_TEMPLATE, HERMES_TEMPLATE, QWEN25_TEMPLATE],
                         ids=["qwen-xml", "json", "qwen2.5"])
def test_the_forcing_grammar_accepts_what_the_template_writes_and_nothing_else(source):
    form = tool_format(source)
    grammar = form.grammar([WEATHER, CLOCK], parallel=True)
    one = rendered_answer(source, CALLS[:1])
    both = rendered_answer(source, CALLS)
    assert accepts(grammar, one)
    assert accepts(grammar, both)
    assert not accepts(form.grammar([WEATHER, CLOCK], parallel=False), both)
    assert not accepts(grammar, "Sure! " + one)  # a forced call is only the call
    assert not accepts(form.grammar([CLOCK], parallel=False), one)  # a named function is the only one
    missing = rendered_answer(source, [{"type": "function", "function": {"name": "get_weather",
                                                                         "arguments": {"days": 2}}}])
    assert not accepts(grammar, missing)  # `city` is required


def test_a_call_serialises_its_arguments_as_openai_does():
    call = ToolCall("f", {"x": "é", "n": 1})
    assert json.loads(call.arguments_json) == {"x": "é", "n": 1}
    assert call.id.startswith("call_")


def test_forced_raw_strings_are_bounded():
    bounded = Tool("f", "", {"type": "object", "properties": {"s": {"type": "string", "minLength": 2,
                                                                     "maxLength": 5}}, "required": ["s"]})
    grammar = QwenXmlFormat().grammar([bounded], parallel=False)

    def call(value: str) -> str:
        return f"<tool_call>\n<function=f>\n<parameter=s>\n{value}\n</parameter>\n</function>\n</tool_call>"

    assert accepts(grammar, call("ab")) and accepts(grammar, call("a\nbcd"))
    assert not accepts(grammar, call("a")) and not accepts(grammar, call("abcdef"))
    unbounded = QwenXmlFormat().grammar([Tool("f", "", {"type": "object", "properties": {"s": {"type": "string"}}})],
                                        parallel=False)
    assert accepts(unbounded, call("x" * MAX_STRING_CHARS))
    assert not accepts(unbounded, call("x" * (MAX_STRING_CHARS + 1)))


@pytest.mark.parametrize("source", [QWEN35_TEMPLATE, HERMES_TEMPLATE, QWEN25_TEMPLATE, LFM2_TEMPLATE],
                         ids=["qwen-xml", "json", "qwen2.5", "lfm2"])
def test_a_value_holding_the_closing_tag_does_not_end_the_call(source):
    form = tool_format(source)
    city = f"a{form.close}b"
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]
    text = rendered_answer(source, calls)
    stream = ToolCallStream(form, [WEATHER])
    pieces = [p for ch in text for p in stream.push(ch)] + stream.finish()
    assert [(p.name, p.arguments) for p in pieces] == [("get_weather", {"city": city})]


LLAMA3_TEMPLATE = (TEMPLATES / "llama3.2.jinja").read_text()


def llama3_answer(call: dict) -> str:
    """The assistant message Llama 3.2's template writes for one call, between its header and <|eot_id|>."""
    text = ChatTemplate(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>").render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        add_generation_prompt=False, date_string="05 Dec 2026")
    return text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[-1].removesuffix("<|eot_id|>")


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_a_llama3_answer_that_is_a_call_is_read_back_whatever_the_chunking(chunk):
    form = tool_format(LLAMA3_TEMPLATE)
    assert isinstance(form, JsonFormat) and form.arguments == "parameters"
    text = llama3_answer(CALLS[0])
    assert text.startswith('{"name": "get_weather", "parameters": {')
    stream = form.stream([WEATHER, CLOCK])
    pieces = [p for i in range(0, len(text), chunk) for p in stream.push(text[i : i + chunk])] + stream.finish()
    assert [(p.name, p.arguments) for p in pieces] == [("get_weather", CALLS[0]["function"]["arguments"])]


@pytest.mark.parametrize("text", ["The weather is fine {really}.", '  {"name": "unknown", "parameters": {}}',
                                  '{"name": "get_weather", "parameters": {"city": "Par', "{not json"])
def test_a_llama3_answer_that_is_not_a_call_is_content_as_written(text):
    stream = tool_format(LLAMA3_TEMPLATE).stream([WEATHER])
    pieces = [p for ch in text for p in stream.push(ch)] + stream.finish()
    assert "".join(pieces) == text and not stream.calls


def test_the_llama3_forcing_grammar_accepts_one_call_as_the_template_writes_it():
    form = tool_format(LLAMA3_TEMPLATE)
    grammar = form.grammar([WEATHER, CLOCK], parallel=True)  # its template renders one call a message
    assert accepts(grammar, llama3_answer(CALLS[0]))
    assert accepts(grammar, llama3_answer(CALLS[1]))
    assert not accepts(grammar, "Sure! " + llama3_answer(CALLS[1]))
    assert not accepts(grammar, llama3_answer(CALLS[0]).replace('"parameters"', '"arguments"'))


def lfm2_read(text: str, chunk: int = 1) -> list:
    stream = Lfm2Format().stream([WEATHER, CLOCK])
    return [p for i in range(0, len(text), chunk) for p in stream.push(text[i : i + chunk])] + stream.finish()


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_lfm2_python_calls_are_read_as_literals(chunk):
    text = ("Checking.<|tool_call_start|>[get_weather(city=\"Paris\", days=-3, metric=True, unit='c', "
            "where={'lat': 1.5, \"tags\": [None, false, null, true]}), clock()]<|tool_call_end|>Done.")
    pieces = lfm2_read(text, chunk)
    calls_at = [i for i, p in enumerate(pieces) if isinstance(p, ToolCall)]
    assert "".join(pieces[: calls_at[0]]) == "Checking." and "".join(pieces[calls_at[-1] + 1 :]) == "Done."
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == [
        ("get_weather", {"city": "Paris", "days": -3, "metric": True, "unit": "c",
                         "where": {"lat": 1.5, "tags": [None, False, None, True]}}),
        ("clock", {})]


def test_lfm2_5_template_calls_are_read_back():
    """LiquidAI's LFM2.5 template writes Python calls: strings in single quotes, True / None."""
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {
        "city": "Paris, France", "days": 3, "metric": True, "unit": None, "where": {"lat": 1.5}}}},
             {"type": "function", "function": {"name": "clock", "arguments": {}}}]
    text = rendered_answer(LFM25_TEMPLATE, calls, content="Let me look.")
    assert text.endswith("[get_weather(city='Paris, France', days=3, metric=True, unit=None, "
                         'where={"lat": 1.5}), clock()]<|tool_call_end|>')
    pieces = lfm2_read(text, 3)
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look."
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_lfm2_json_strings_read_as_json():
    [call] = lfm2_read('<|tool_call_start|>[get_weather(city="\\ud83d\\ude00 a\\/b")]<|tool_call_end|>')
    assert call.arguments == {"city": "😀 a/b"}


@pytest.mark.parametrize("text", [
    "<|tool_call_start|>[unknown(city='x')]<|tool_call_end|>",  # not one of the tools
    "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>",  # positional: no argument name
    "<|tool_call_start|>[get_weather(city=__import__('os').getcwd())]<|tool_call_end|>",  # not a literal
    "<|tool_call_start|>[get_weather(**{'city': 'x'})]<|tool_call_end|>",
    "<|tool_call_start|>get_weather(city='x')<|tool_call_end|>",  # not a list
    "<|tool_call_start|>[]<|tool_call_end|>",
    "<|tool_call_start|>[get_weather(city='x'), unknown()]<|tool_call_end|>",
    "<|tool_call_start|>[get_weather(city='Par",  # never closed
    "a [get_weather(city='x')] b <|tool_call_sta",
])
def test_lfm2_text_that_is_not_a_call_is_kept(text):
    stream = Lfm2Format().stream([WEATHER, CLOCK])
    pieces = [p for ch in text for p in stream.push(ch)] + stream.finish()
    assert "".join(pieces) == text and not stream.calls


def test_the_lfm2_forcing_grammar_writes_python_calls_that_read_back():
    grammar = Lfm2Format().grammar([WEATHER, CLOCK], parallel=True)
    one = '<|tool_call_start|>[get_weather(city="Paris", days=3, where={"lat": 1.5})]<|tool_call_end|>'
    both = '<|tool_call_start|>[get_weather(city="Paris", metric=true), clock()]<|tool_call_end|>'
    for text in (one, both):
        assert accepts(grammar, text)
        assert all(isinstance(p, ToolCall) for p in lfm2_read(text))
    assert accepts(grammar, '<|tool_call_start|>[get_weather(city="x", days=1, metric=false, unit="f", '
                            'where={})]<|tool_call_end|>')
    assert not accepts(Lfm2Format().grammar([WEATHER, CLOCK], parallel=False), both)
    assert not accepts(grammar, "Sure! " + one)
    assert not accepts(grammar, '<|tool_call_start|>[get_weather(days=3)]<|tool_call_end|>')  # `city` is required
    assert not accepts(grammar, '<|tool_call_start|>[get_weather(days=3, city="x")]<|tool_call_end|>')  # in order
    assert not accepts(Lfm2Format().grammar([CLOCK], parallel=False), one)
