"""Stop strings over streamed text: however the text is cut into deltas, the emitted text is the
text before the first stop string to be completed, as generation would stop there (all of it when
none occurs)."""

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
    ends = [end for end in range(1, len(text) + 1) if any(s and text[:end].endswith(s) for s in stops)]
    if not ends:
        return text, False
    first = min(ends)
    return text[: first - max(len(s) for s in stops if s and text[:first].endswith(s))], True


@given(st.lists(st.text("ab\n", min_size=1, max_size=3), max_size=3), st.lists(st.text("ab\n", max_size=4), max_size=12))
def test_any_split_of_the_text_gives_the_whole_string_result(stops, pieces):
    assert stream(stops, pieces) == expected(stops, "".join(pieces))


def test_a_possible_stop_prefix_is_held_back_then_released():
    matcher = StopMatcher(("</end>",))
    assert matcher.push("answer </e") == ("answer ", False)
    assert matcher.push("xtra") == ("</extra", False)
    assert matcher.push(" </end> tail") == (" ", True)


def test_a_stop_completed_first_wins_over_a_longer_one_begun_before_it():
    stops = ("\n", "a\n\n")
    assert stream(stops, ["a\n\n"]) == stream(stops, ["a\n", "\n"]) == ("a", True)


def test_no_stop_strings_pass_everything_through():
    matcher = StopMatcher(())
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""
