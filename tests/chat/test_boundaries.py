"""Message boundaries found from one marked render, against the old algorithm (every prefix of the
conversation rendered and encoded again) on seeded conversations with both templates: SmolLM2's
ChatML and Qwen3.5's (system prompts, tools offered, tool calls and results, reasoning, thinking
on and off). Also what the prefix cache relies on: a boundary and the tokens before it do not
depend on what follows, and `answered` gives the next request's tokens up to the answer's end."""

import random

import pytest

from pagelm.chat.boundaries import marked_source
from pagelm.chat.model import ChatModel
from pagelm.chat.template import TemplateError

WORDS = ["the", "cat", "sat", " on", "mat", "\n", "\n\n", "  ", "é", "日本", "42", "3.14", "<think>", "x_y", "!", "?",
         "tool", "Hello", "wörld", "\t"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def old_boundaries(chat: ChatModel, messages: list[dict], think=None, tools=None) -> list[int]:
    """The algorithm before the marked render, quadratic: each prefix of the conversation rendered
    and encoded again (bench/boundaries.py times it against the new one)."""
    text = chat.template.render(messages, add_generation_prompt=True, enable_thinking=think, tools=tools)
    tokens = chat.tokenizer.encode(text, add_special=True)
    boundaries = []
    for k in range(len(messages)):
        try:
            part = chat.template.render(messages[: k + 1], add_generation_prompt=False, enable_thinking=think,
                                        tools=tools)
        except TemplateError:
            try:
                other = chat.template.render(messages[: k + 1] + [{"role": "user", "content": "\x00"}],
                                             add_generation_prompt=False, enable_thinking=think, tools=tools)
            except TemplateError:
                continue
            ids = chat.tokenizer.encode(other, add_special=True)
            common = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
            if 0 < common < len(tokens):
                boundaries.append(common)
            continue
        if not part or not text.startswith(part):
            continue
        ids = chat.tokenizer.encode(part, add_special=True)
        if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids:
            boundaries.append(len(ids))
    return sorted(set(boundaries))


def text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 12))).strip() or "hi"


def conversation(seed: int) -> tuple[list[dict], bool | None, list | None]:
    """(messages ending with a user or tool message, think, tools) of a seeded random chat."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": text(rng)}] if rng.random() < 0.6 else []
    for _ in range(rng.randint(1, 6)):
        messages.append({"role": "user", "content": text(rng)})
        if rng.random() < 0.3:
            calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": text(rng)}}}
                     for _ in range(rng.randint(1, 2))]
            messages.append({"role": "assistant", "content": text(rng) if rng.random() < 0.5 else "",
                             "tool_calls": calls})
            messages += [{"role": "tool", "content": text(rng)} for _ in calls]
        answer = {"role": "assistant", "content": text(rng)}
        if rng.random() < 0.3:
            answer["reasoning_content"] = text(rng)
        messages.append(answer)
    if rng.random() < 0.8:
        messages.append({"role": "user", "content": text(rng)})
    else:
        messages.append({"role": "tool", "content": text(rng)})
    return messages, rng.choice([None, False, True]), TOOLS if rng.random() < 0.4 else None


SEEDS = range(60)


def ends_of(chat, messages, think, tools):
    return chat._render(messages, think, tools)[1]


def test_chatml_boundaries_are_the_old_ones(smollm2_chat):
    for seed in SEEDS:
        messages, think, _ = conversation(seed)
        prompt = smollm2_chat.chat_prompt(messages, think)
        assert prompt.boundaries == old_boundaries(smollm2_chat, messages, think), seed
        assert len(prompt.boundaries) == len(messages)  # every message ends before the next <|im_start|>


def test_qwen_boundaries_are_the_old_ones_plus_the_ends_of_past_answers(qwen35_chat):
    """The old algorithm found Qwen3.5's system end through a probe user message, so past the next
    turn's `<|im_start|>user\\n`, and no end for a past answer (a conversation cut after an answer
    renders it with a think block): now the system ends before that header, and each past answer
    and group of tool results ends where the template writes it in the conversation."""
    for seed in SEEDS:
        messages, think, tools = conversation(seed)
        prompt = qwen35_chat.chat_prompt(messages, think, tools)
        old = old_boundaries(qwen35_chat, messages, think, tools)
        ends = ends_of(qwen35_chat, messages, think, tools)
        header = qwen35_chat.tokenizer.encode("<|im_start|>user\n")
        expected = set(old)
        if messages[0]["role"] == "system":
            system_end = ends[0]
            assert prompt.tokens[system_end:system_end + len(header)] == header, seed
            assert system_end + len(header) in old, seed
            expected = (expected - {system_end + len(header)}) | {system_end}
        for k, message in enumerate(messages[:-1]):
            following = messages[k + 1]["role"]
            if message["role"] == "assistant" or message["role"] == "tool" and following != "tool":
                assert ends[k] is not None, (seed, k)
                expected.add(ends[k])
            if message["role"] == "tool" and following == "tool":
                assert ends[k] is None, (seed, k)  # the group's user turn goes on
        assert prompt.boundaries == sorted(expected), seed


def conversations(which: str):
    """(seed, messages, think, tools) of each seed; SmolLM2's template renders no tools."""
    for seed in SEEDS:
        messages, think, tools = conversation(seed)
        yield seed, messages, think, tools if which == "qwen35_chat" else None


@pytest.mark.parametrize("which", ["qwen35_chat", "smollm2_chat"])
def test_a_boundary_and_the_tokens_before_it_do_not_depend_on_what_follows(which, request):
    chat = request.getfixturevalue(which)
    for seed, messages, think, tools in conversations(which):
        prompt = chat.chat_prompt(messages, think, tools)
        ends = ends_of(chat, messages, think, tools)
        for k in range(len(messages) - 1):
            if ends[k] is None or messages[k + 1]["role"] != "user":
                continue
            other = chat.chat_prompt([*messages[:k + 1], {"role": "user", "content": f"other {seed}"}], think, tools)
            assert other.tokens[:ends[k]] == prompt.tokens[:ends[k]], (seed, k)
            assert [b for b in other.boundaries if b <= ends[k]] == [b for b in prompt.boundaries if b <= ends[k]]


@pytest.mark.parametrize("which", ["qwen35_chat", "smollm2_chat"])
def test_answered_is_the_next_request_up_to_the_end_of_the_answer(which, request):
    chat = request.getfixturevalue(which)
    for seed, messages, think, tools in conversations(which):
        reasoning, content = ("", "Sunny, 21 °C.") if seed % 2 else ("It is warm.", "Warm\n\nand dry.")
        answered = chat.chat_prompt(messages, think, tools).answered(reasoning, content)
        answer = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        following = chat.chat_prompt([*messages, answer, {"role": "user", "content": "And tomorrow?"}], think, tools)
        end = answered.boundaries[-1]
        assert end == len(answered.tokens) and end in following.boundaries
        assert following.tokens[:end] == answered.tokens, seed
        assert answered.boundaries == [b for b in following.boundaries if b <= end]
        assert chat.tokenizer.decode(answered.tokens).endswith(content + "<|im_end|>\n")


def test_qwen_answer_is_rendered_without_the_think_block_of_its_generation_prompt(qwen35_chat):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = qwen35_chat.chat_prompt(messages, think=False)
    assert qwen35_chat.tokenizer.decode(prompt.tokens).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answered = prompt.answered("", "Hello!")
    assert answered.tokens[:prompt.boundaries[-1]] == prompt.tokens[:prompt.boundaries[-1]]
    assert qwen35_chat.tokenizer.decode(answered.tokens[prompt.boundaries[-1]:]) == "<|im_start|>assistant\nHello!<|im_end|>\n"


def test_marks_go_into_loops_over_the_messages_only_and_keep_whitespace_control():
    source = ("{%- for m in messages -%}\n  {% for p in m.parts %}{{ p }}{% endfor %}{{ m.content }}\n{%- endfor %}"
              "{% for x in loop_messages %}\n{{ x }}{% endfor %}")
    marked, loops = marked_source(source)
    assert loops == 2
    assert marked == ("{%- for m in messages -%}{% if true %}\U000F0000{% endif -%}\n  {% for p in m.parts %}{{ p }}"
                      "{% endfor %}{{ m.content }}\n{%- endfor %}{% if true %}\U000F0001{% endif %}"
                      "{% for x in loop_messages %}{% if true %}\U000F0002{% endif %}\n{{ x }}{% endfor %}"
                      "{% if true %}\U000F0003{% endif %}")
    assert marked_source("{% endfor %}{% for m in messages %}") == ("{% endfor %}{% for m in messages %}", 0)


def test_content_holding_a_mark_gets_no_boundaries(smollm2_chat):
    messages = [{"role": "user", "content": "a \U000F0000 b"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "c"}]
    assert smollm2_chat.chat_prompt(messages).boundaries == []
