"""pagelm.chat.reasoning: whole-string split and the streaming splitter agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelm.chat.reasoning import ReasoningSplitter, split


def stream(text: str, cuts: list[int], think_open: bool, **tags) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = ReasoningSplitter(think_open, **tags)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    deltas = [splitter.push(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(splitter.finish())
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize("text, think_open, expected", [
    # prompt left <think> open (Qwen thinking on)
    ("Let me think.\n</think>\n\nThe answer is 4.", True, ("Let me think.", "The answer is 4.")),
    ("\nplan\n\n</think>\n\nhi\n", True, ("plan", "hi\n")),
    ("still thinking", True, ("still thinking", "")),
    ("</think>\n\nno reasoning", True, ("", "no reasoning")),
    # thinking off, the model does not think
    ("Hello there", False, ("", "Hello there")),
    ("\n  Hello", False, ("", "\n  Hello")),
    ("a <think> b </think> c", False, ("", "a <think> b </think> c")),
    ("", False, ("", "")),
    ("   ", False, ("", "   ")),
    ("<thi", False, ("", "<thi")),
    # the model opens its own <think>
    ("<think>\nhmm\n</think>\n\nok", False, ("hmm", "ok")),
    ("\n <think>x</think>y", False, ("x", "y")),
    ("<think>unterminated\n", False, ("unterminated", "")),
    # later tags are text
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("<think>a<think>b</think>c", False, ("a<think>b", "c")),
    ("x</thinking>y", True, ("x</thinking>y", "")),
])
def test_split_examples(text, think_open, expected):
    assert split(text, think_open) == expected
    reasoning, content, _ = stream(text, list(range(len(text))), think_open)  # one character at a time
    assert (reasoning, content) == expected


def test_tag_split_across_deltas_is_never_emitted_in_part():
    s = ReasoningSplitter(think_open=True)
    assert s.push("because") == ("because", "")
    assert s.in_reasoning
    assert s.push("\n</thi") == ("", "")  # held: newline and partial tag
    assert s.push("nk>") == ("", "")
    assert not s.in_reasoning
    assert s.push("\n") == ("", "")  # newline after </think> is dropped
    assert s.push("\nAnswer") == ("", "Answer")
    assert s.push(" <think>") == ("", " <think>")
    assert s.finish() == ("", "")


def test_partial_tag_that_turns_out_to_be_text():
    s = ReasoningSplitter(think_open=True)
    assert s.push("a</thi") == ("a", "")
    assert s.push("s is text") == ("</this is text", "")
    assert s.push("</") == ("", "")
    assert s.finish() == ("</", "")


def test_model_opens_think_itself_streaming():
    s = ReasoningSplitter(think_open=False)
    assert s.push(" \n<th") == ("", "")
    assert s.push("ink>\nidea") == ("idea", "")
    assert s.push("</think>\n\nDone.") == ("", "Done.")
    s = ReasoningSplitter(think_open=False)
    assert s.push("<tag>") == ("", "<tag>")


def test_finish_then_push_raises():
    s = ReasoningSplitter(think_open=False)
    s.push("x")
    s.finish()
    assert s.finish() == ("", "")
    with pytest.raises(ValueError):
        s.push("y")


def test_custom_tags():
    assert split("[r]a[/r]\nb", False, start="[r]", end="[/r]") == ("a", "b")
    r, c, _ = stream("[r]a[/r]\nb", [1, 2, 5, 6], False, start="[r]", end="[/r]")
    assert (r, c) == ("a", "b")


FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "</thi", "nk>", "think", ">", "\n", "\n\n", " ", "\t",
             "a", "b", "é", "<<", "</think", "/"]


@settings(max_examples=1500, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=24),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
    think_open=st.booleans(),
)
def test_streaming_equals_whole_string(pieces, cuts, think_open):
    text = "".join(pieces)
    reasoning, content, deltas = stream(text, cuts, think_open)
    assert (reasoning, content) == split(text, think_open)
    # what was emitted is never retracted and never holds a tag fragment that later became a tag
    emitted_r = ""
    emitted_c = ""
    for r, c in deltas:
        emitted_r += r
        emitted_c += c
        assert reasoning.startswith(emitted_r) and content.startswith(emitted_c)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8), think_open=st.booleans())
def test_streaming_equals_whole_string_any_text(text, cuts, think_open):
    reasoning, content, _ = stream(text, cuts, think_open)
    assert (reasoning, content) == split(text, think_open)
