"""The chat templates of the model families (tests/chat/templates/, sources in its README) render
in pagelm's sandboxed engine exactly as transformers renders them: a conversation with a system
message, two turns, a tool call and its result, with tools offered, and thinking on and off
where the family has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagelm.chat.template import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C and sunny"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
FAMILIES = {  # template file, special tokens, the keyword arguments each family's template reads
    "qwen3": ("qwen3.jinja", {"bos_token": "", "eos_token": "<|im_end|>"},
              [{}, {"enable_thinking": True}, {"enable_thinking": False}]),
    "qwen2.5": ("qwen2.5.jinja", {"bos_token": "", "eos_token": "<|im_end|>"}, [{}]),
    "lfm2": ("lfm2.jinja", {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>"}, [{}]),
    "lfm2.5": ("lfm2.5.jinja", {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>"}, [{}]),
    "llama3.2": ("llama3.2.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                 [{"date_string": "05 Dec 2026"}]),
    "gpt-oss": ("gpt-oss.jinja", {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
                [{}, {"reasoning_effort": "high"}]),
}
CASES = [(family, kwargs) for family, (_, _, variants) in FAMILIES.items() for kwargs in variants]


def hf_render(source: str, messages, tools, add_generation_prompt: bool, **kwargs) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template(conversations=[messages], tools=tools, chat_template=source,
                                              add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no-tools", "tools"])
@pytest.mark.parametrize("family, kwargs", CASES, ids=[f"{f}-{'-'.join(map(str, k.values())) or 'default'}"
                                                       for f, k in CASES])
def test_a_family_template_renders_as_transformers_does(family, kwargs, tools):
    file, specials, _ = FAMILIES[family]
    source = (TEMPLATES / file).read_text()
    template = ChatTemplate(source, name=family, **specials)
    messages = CONVERSATION if family != "llama3.2" or tools else [m for m in CONVERSATION if m["role"] != "tool"
                                                                    and not m.get("tool_calls")]
    for generation_prompt in (True, False):
        ours = template.render(messages, add_generation_prompt=generation_prompt, tools=tools, **kwargs)
        assert ours == hf_render(source, messages, tools, generation_prompt, **specials, **kwargs)


def test_qwen3_thinking_is_left_open_unless_turned_off():
    template = ChatTemplate((TEMPLATES / "qwen3.jinja").read_text(), name="qwen3")
    assert template.think_open(enable_thinking=None) is False  # Qwen3 leaves the model to open it
    off = template.render(CONVERSATION, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not template.think_prefix(off)
