"""OpenAI's harmony format (gpt-oss): an answer is a series of messages, each a header naming its
channel (and for a tool call its recipient) and a body:

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

The generation prompt ends in `<|start|>assistant`, so the first header comes without it; `<|return|>`
ends the answer and `<|call|>` a call (both stop tokens), `<|end|>` only a message.

Owns reading a streamed answer into reasoning (the analysis channel) and content (the final and
commentary channels), where a call's message is passed on to the content in one fixed form, the one
gpt-oss's template renders a past call in (`CALL_OPEN`...`CALL_CLOSE`), for `tools.HarmonyFormat`
to read; and the grammar prefix that lets a constrained answer reason first.
"""

from __future__ import annotations

import re

from pagelm.chat.reasoning import partial_suffix

CHANNEL, MESSAGE, START, END, CALL, RETURN = "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>"
CONSTRAIN = "<|constrain|>"
# a call as gpt-oss's template renders one: CALL_OPEN + "functions.NAME<|channel|>commentary json<|message|>"
# + arguments + CALL_CLOSE
CALL_OPEN, CALL_CLOSE = "<|start|>assistant to=", CALL
STOP_TOKENS = (RETURN, CALL)  # the answer's end, a call's end
# what a harmony answer may begin with: a header, or a recipient before one
_HEADER_STARTS = (CHANNEL, START, " to=", "to=")
_ENDS = (END, CALL, RETURN)
_MAX_HEADER_CHARS = 256  # longer text before a `<|message|>` is not a header: content as it is
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"(\w+)")


def is_harmony(template_source: str | None) -> bool:
    """Whether a chat template writes harmony (channels and messages)."""
    return bool(template_source) and CHANNEL in template_source and MESSAGE in template_source


def analysis_first(final: bool) -> str:
    """The Lark rule `start` of a constrained answer: an analysis message (gpt-oss reasons first),
    the next message's start, then (`final`: the final channel's header and) the sub-grammar `answer`."""
    header = f' {CHANNEL} "final" {MESSAGE}' if final else ""
    return f'start: {CHANNEL} "analysis" {MESSAGE} /(.|\\n)*/ {END} {START} "assistant"{header} @answer'


def call_text(name: str, arguments: str) -> str:
    """A call to `name` (a recipient such as `functions.get_weather`) in CALL_OPEN...CALL_CLOSE form."""
    return f"{CALL_OPEN}{name}{CHANNEL}commentary json{MESSAGE}{arguments}{CALL_CLOSE}"


class HarmonySplitter:
    """A harmony answer as it streams: `push(delta) -> (reasoning_delta, content_delta)`, then
    `finish()`; the same interface (and the same result for any chunking) as
    `reasoning.ReasoningSplitter`. Text that is not harmony (no header where one should be) is
    content as it is, so nothing the model wrote is lost."""

    def __init__(self) -> None:
        self._pending = ""
        self._header: str | None = ""  # the header being read; None inside a body
        self._kind = ""  # the body's: "reasoning", "content" or "call"
        self._recipient = ""  # a call's (`functions.NAME`)
        self._call = ""  # a call's arguments so far (passed on whole, when its message ends)
        self._plain = False  # not harmony: everything is content
        self._done = False

    def push(self, delta: str) -> tuple[str, str]:
        if self._done:
            raise ValueError("push() after finish()")
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        if self._done:
            return "", ""
        out = self._advance(final=True)
        self._done = True
        return out

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._plain:
                content.append(self._pending)
                self._pending = ""
            elif self._header is not None:
                if not self._read_header(final, content):
                    break
            elif not self._read_body(final, reasoning, content):
                break
        if final and self._header is None and self._kind == "call":
            content.append(call_text(self._recipient, self._call))  # a call ends with the answer (<|call|> stops)
            self._kind = ""
        return "".join(reasoning), "".join(content)

    def _read_header(self, final: bool, content: list[str]) -> bool:
        """Moves the text up to a `<|message|>` into the header; False while it waits for more."""
        text = self._header + self._pending
        i = text.find(MESSAGE)
        starts = any(text.startswith(s) or s.startswith(text) for s in _HEADER_STARTS)
        if not starts or (i < 0 and (final or len(text) > _MAX_HEADER_CHARS)):
            self._plain, self._header, self._pending = True, None, text
            return True
        if i < 0:
            self._header, self._pending = text, ""
            return False
        header, self._pending, self._header = text[:i], text[i + len(MESSAGE):], None
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient is not None and recipient.group(1) != "assistant":
            self._kind, self._recipient, self._call = "call", recipient.group(1), ""
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return True

    def _read_body(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Passes on the body's text up to its end (or what cannot be the start of one); False
        while the rest may be an end marker split across deltas."""
        p = self._pending
        ends = [(p.find(e), e) for e in _ENDS if e in p]
        if ends:
            i, marker = min(ends)
            self._emit(p[:i], reasoning, content)
            if self._kind == "call":
                content.append(call_text(self._recipient, self._call))
            self._pending, self._header, self._kind = p[i + len(marker):], "", ""
            return True
        hold = 0 if final else max(partial_suffix(p, e) for e in _ENDS)
        self._emit(p[: len(p) - hold], reasoning, content)
        self._pending = p[len(p) - hold:]
        return False

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._kind == "reasoning":
            reasoning.append(text)
        elif self._kind == "content":
            content.append(text)
        else:
            self._call += text

