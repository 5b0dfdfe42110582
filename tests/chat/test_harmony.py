"""OpenAI's harmony format (gpt-oss): answers split into reasoning, content and tool calls as they
stream, whatever the chunking; calls read back from what gpt-oss's real template renders; the
grammars of a forced call and of a JSON answer after an analysis message; the reasoning budget's
close; the stop tokens of a harmony vocabulary."""

from __future__ import annotations

import json

import pytest
from harmony_model import HARMONY_TOKENS, TEMPLATE

from pagelm.chat.budget import HARMONY, ReasoningBudget
from pagelm.chat.grammar import Grammar
from pagelm.chat.harmony import HarmonySplitter, call_text, is_harmony
from pagelm.chat.template import ChatTemplate
from pagelm.chat.tokenizer import Tokenizer
from pagelm.chat.tools import HarmonyFormat, Tool, ToolCall, tool_format
from pagelm.formats.gguf import GGUFFile

WEATHER = Tool("get_weather", "Weather for a city",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ANALYSIS_THEN_FINAL = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
# as gpt-oss writes a call: the recipient after the channel, the content type constrained
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')


def _split(text: str, size: int) -> tuple[str, str]:
    splitter = HarmonySplitter()
    pieces = [splitter.push(text[i : i + size]) for i in range(0, len(text), size)] + [splitter.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_an_answer_splits_into_analysis_and_final_whatever_the_chunking(size):
    assert _split(ANALYSIS_THEN_FINAL, size) == ("The user greets; answer briefly.", "Hello! How can I help?")


@pytest.mark.parametrize("size", [1, 4, 7, 1000])
@pytest.mark.parametrize("written", [
    CALL,  # the recipient after the channel, as models write it
    "<|channel|>analysis<|message|>Need the weather.<|end|>"  # the recipient in the role, as the template renders it
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}'])
def test_a_call_is_passed_on_in_the_templates_form_and_read_as_a_tool_call(written, size):
    reasoning, content = _split(written, size)
    assert reasoning == "Need the weather."
    assert content == call_text("functions.get_weather", '{"city":"Paris"}')
    stream = HarmonyFormat().stream([WEATHER])
    out = stream.push(content) + stream.finish()
    assert [(c.name, c.arguments) for c in out if isinstance(c, ToolCall)] == [("get_weather", {"city": "Paris"})]
    assert not [c for c in out if isinstance(c, str)]


def test_text_that_is_not_harmony_is_content_and_a_call_to_an_unknown_tool_comes_back_as_text():
    assert _split("Plain words, no channels.", 4) == ("", "Plain words, no channels.")
    _, content = _split(CALL.replace("get_weather", "launch"), 3)
    stream = HarmonyFormat().stream([WEATHER])
    assert "".join(stream.push(content) + stream.finish()) == content  # nothing the model wrote is lost


def test_an_answer_cut_off_inside_its_analysis_is_all_reasoning():
    assert _split("<|channel|>analysis<|message|>Still thinking about", 3) == ("Still thinking about", "")


def test_gpt_oss_template_is_harmony_and_its_past_calls_read_back_as_the_calls_they_were():
    assert is_harmony(TEMPLATE) and isinstance(tool_format(TEMPLATE), HarmonyFormat)
    template = ChatTemplate(TEMPLATE, name="gpt-oss", bos_token="<|startoftext|>", eos_token="<|return|>")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18C"}]
    text = template.render(messages, add_generation_prompt=True, tools=[WEATHER.for_template()])
    stream = HarmonyFormat().stream([WEATHER])
    calls = [c for c in stream.push(text) + stream.finish() if isinstance(c, ToolCall)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert text.endswith("<|start|>assistant")


@pytest.fixture(scope="module")
def tokenizer(harmony_gguf) -> Tokenizer:
    with GGUFFile.open(harmony_gguf) as file:
        return Tokenizer.from_gguf(file)


def test_a_harmony_vocabulary_stops_at_return_and_call_never_at_a_messages_end(tokenizer):
    ends = set(tokenizer.eos_ids)
    assert {HARMONY_TOKENS["<|return|>"], HARMONY_TOKENS["<|call|>"]} <= ends
    assert HARMONY_TOKENS["<|end|>"] not in ends


def _accepts(grammar: Grammar, text: str, tokenizer: Tokenizer) -> bool:
    matcher = grammar.matcher(harmony=True)
    try:
        for token in tokenizer.encode(text):
            matcher.accept(token)
    except Exception:
        return False
    return True


def test_a_forced_call_and_a_json_answer_come_after_an_analysis_message(tokenizer):
    call = Grammar.lark(tokenizer, HarmonyFormat().grammar([WEATHER], parallel=True))
    assert _accepts(call, CALL.replace('{"city":"Paris"}', '{"city": "Paris"}'), tokenizer)
    assert not _accepts(call, CALL.replace("get_weather", "launch"), tokenizer)
    assert not _accepts(call, CALL[CALL.index("<|start|>") + len("<|start|>assistant"):], tokenizer)  # no analysis
    answer = Grammar.json_schema(tokenizer, {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"]})
    analysis = ANALYSIS_THEN_FINAL[: ANALYSIS_THEN_FINAL.index("Hello")]
    assert _accepts(answer, analysis + json.dumps({"n": 3}, separators=(",", ":")), tokenizer)
    assert not _accepts(answer, analysis + "Hello", tokenizer)


def test_a_spent_budget_closes_the_analysis_message_and_an_answer_on_another_channel_is_not_bounded(tokenizer):
    budget = ReasoningBudget(tokenizer, 2, marks=HARMONY)
    for token in tokenizer.encode("<|channel|>analysis<|message|>one two"):
        budget.accept(token)
    assert budget.forcing == tokenizer.encode("<|end|><|start|>assistant")
    final = ReasoningBudget(tokenizer, 2, marks=HARMONY)
    for token in tokenizer.encode("<|channel|>final<|message|>one two three four"):
        final.accept(token)
    assert final.closed and not final.forcing
    nothing = ReasoningBudget(tokenizer, 0, marks=HARMONY)
    assert nothing.forcing == tokenizer.encode("<|channel|>analysis<|message|><|end|><|start|>assistant")


def test_a_reasoning_effort_reaches_gpt_oss_template(harmony_gguf):
    from pagelm.chat.model import ChatModel

    chat = ChatModel.open(harmony_gguf)
    ask = [{"role": "user", "content": "Hi"}]

    def system(think) -> str:
        text = chat.tokenizer.decode(chat.chat_prompt(ask, think).tokens)
        return text[text.index("Reasoning:"): text.index("\n", text.index("Reasoning:"))]

    assert [system(t) for t in (None, True, "low", "high")] == ["Reasoning: medium"] * 2 + ["Reasoning: low",
                                                                                              "Reasoning: high"]
    assert chat.thinks and chat.chat_prompt(ask).harmony
