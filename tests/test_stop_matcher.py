"""Stop strings over streamed text: however the text is cut into deltas, the emitted text is the
text before the first stop string (all of it when none occurs)."""

from hypothesis import given
from hypothesis import strategies as st

from pagelm.serve.worker import StopMatcher


def stream(stops, pieces):
    matcher, out = StopMatcher(tuple(stops)), []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def expected(stops, text):
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@given(st.lists(st.text("ab\n", min_size=1, max_size=3), max_size=3), st.lists(st.text("ab\n", max_size=4), max_size=12))
def test_any_split_of_the_text_gives_the_whole_string_result(stops, pieces):
    assert stream(stops, pieces) == expected(stops, "".join(pieces))


def test_a_possible_stop_prefix_is_held_back_then_released():
    matcher = StopMatcher(("</end>",))
    assert matcher.push("answer </e") == ("answer ", False)
    assert matcher.push("xtra") == ("</extra", False)
    assert matcher.push(" </end> tail") == (" ", True)


def test_no_stop_strings_pass_everything_through():
    matcher = StopMatcher(())
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""
