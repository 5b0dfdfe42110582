"""Split a thinking model's output into reasoning and content.

Qwen-style convention:

* when the prompt leaves ``<think>`` open (``think_open=True``, see
  :func:`pagelm.chat.template.think_prefix`), the output starts inside the
  reasoning; otherwise, if the output itself begins (after whitespace) with
  ``<think>``, that opens the reasoning; otherwise everything is content;
* the reasoning ends at the first ``</think>``; newlines right after the opening
  tag and right before ``</think>`` are dropped, as are the newlines right after
  ``</think>`` (``"</think>\\n\\n"``), matching how Qwen's template re-reads them;
* later tags are ordinary text.

:func:`split` works on a whole string; :class:`ReasoningSplitter` does the same
on a stream of deltas (a tag split across deltas is held back, never emitted in
part) and gives exactly the same result for any chunking.
"""

from __future__ import annotations

__all__ = ["THINK_END", "ReasoningSplitter", "split"]

THINK_END = "</think>"


def split(text: str, think_open: bool, start: str = "<think>", end: str = "</think>") -> tuple[str, str]:
    """``(reasoning, content)`` of a whole generated text."""
    if think_open:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return "", text
        body = stripped[len(start):]
    i = body.find(end)
    if i < 0:
        return body.strip("\n"), ""
    return body[:i].strip("\n"), body[i + len(end):].lstrip("\n")


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_PRELUDE, _REASONING, _CONTENT_START, _CONTENT, _DONE = range(5)


class ReasoningSplitter:
    """Streaming :func:`split`: ``push(delta) -> (reasoning_delta, content_delta)``, then ``finish()``."""

    def __init__(self, think_open: bool, start: str = "<think>", end: str = "</think>") -> None:
        if not start or not end:
            raise ValueError("start and end tags must be non-empty")
        self.start = start
        self.end = end
        self._state = _REASONING if think_open else _PRELUDE
        self._pending = ""  # text not yet emitted
        self._reasoning_started = False  # leading newlines of the reasoning already dropped

    @property
    def in_reasoning(self) -> bool:
        """True while the output is (still) inside the reasoning block."""
        return self._state == _REASONING

    def push(self, delta: str) -> tuple[str, str]:
        if self._state == _DONE:
            raise ValueError("push() after finish()")
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back (a partial tag is then plain text)."""
        if self._state == _DONE:
            return "", ""
        out = self._advance(final=True)
        self._state = _DONE
        return out

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            p = self._pending
            if self._state == _PRELUDE:
                stripped = p.lstrip()
                if stripped.startswith(self.start):
                    self._pending = stripped[len(self.start):]
                    self._state = _REASONING
                    continue
                if not final and (not stripped or self.start.startswith(stripped)):
                    break  # still could be whitespace + <think>
                self._state = _CONTENT
                continue
            if self._state == _REASONING:
                if not self._reasoning_started:
                    p = p.lstrip("\n")
                    self._pending = p
                    if not p and not final:
                        break
                    self._reasoning_started = True
                i = p.find(self.end)
                if i >= 0:
                    reasoning.append(p[:i].rstrip("\n"))
                    self._pending = p[i + len(self.end):]
                    self._state = _CONTENT_START
                    continue
                if final:
                    reasoning.append(p.rstrip("\n"))
                    self._pending = ""
                    break
                hold = partial_suffix(p, self.end)
                safe = p[: len(p) - hold]
                emit = safe.rstrip("\n")  # trailing newlines may precede </think>
                reasoning.append(emit)
                self._pending = p[len(emit):]
                break
            if self._state == _CONTENT_START:
                p = p.lstrip("\n")
                self._pending = p
                if not p:
                    break
                self._state = _CONTENT
                continue
            if self._state == _CONTENT:
                content.append(p)
                self._pending = ""
                break
            break
        return "".join(reasoning), "".join(content)
