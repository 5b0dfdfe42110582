"""The reasoning budget: how many tokens a thinking model may reason before its think block is
closed for it, and the constraint that closes it.

A model that never closes its reasoning would spend a whole answer inside it; an answer that must
come (a forced tool call, a JSON schema) then never does. So with a forced answer the reasoning
ends, at the latest, where the answer still has room (`FORCED_ANSWER_TOKENS`, or half of
max_tokens when that is less), and a user may bound it lower (`reasoning_budget`), as llama.cpp's
reasoning budget does: the close (`</think>` and the blank line templates write; in harmony the
analysis message's end and the next message's start) is then forced token by token, and what
follows is the answer, under its grammar if it has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagelm.chat import harmony
from pagelm.chat.reasoning import THINK_END
from pagelm.chat.tokenizer import Tokenizer
from pagelm.engine.sampling import Constraint

if TYPE_CHECKING:
    from pagelm.chat.grammar import Grammar

FORCED_ANSWER_TOKENS = 256  # room kept for a forced answer after the reasoning (less when max_tokens is small)


def reasoning_limit(max_tokens: int, budget: int | None, forced: bool) -> int | None:
    """Reasoning tokens before the think block is closed: `budget` (None: no bound), and with a
    forced answer at most max_tokens less the answer's room."""
    if not forced:
        return budget
    limit = max_tokens - min(max_tokens // 2, FORCED_ANSWER_TOKENS)
    return limit if budget is None else min(budget, limit)


@dataclass(frozen=True)
class Marks:
    """How a family's reasoning is written: `header` opens it (empty: the prompt already has),
    `end` closes it, `close` is what a spent budget forces."""

    header: str
    end: str
    close: str


THINK = Marks("", THINK_END, THINK_END + "\n\n")
HARMONY = Marks(f"{harmony.CHANNEL}analysis{harmony.MESSAGE}", harmony.END, f"{harmony.END}{harmony.START}assistant")


def answer_constraint(tokenizer: Tokenizer, grammar: Grammar | None, think_open: bool, max_tokens: int,
                      budget: int | None, harmony: bool = False) -> Constraint | None:
    """What constrains one generation: the grammar (after the reasoning when the prompt leaves a
    think block open, after the analysis message in harmony), behind the reasoning budget when
    there is one."""
    inner = None if grammar is None else grammar.matcher(after_reasoning=think_open, harmony=harmony)
    limit = reasoning_limit(max_tokens, budget, grammar is not None) if think_open or harmony else None
    return inner if limit is None else ReasoningBudget(tokenizer, limit, inner, HARMONY if harmony else THINK)


class ReasoningBudget:
    """A Constraint: after `budget` tokens of reasoning that has not closed by itself, only the
    tokens of the marks' close, one by one; `inner` (the answer's matcher, or None) sees every token.
    Where the reasoning has a header (harmony's analysis message), its tokens are not counted, and
    an answer whose first message is on another channel has no reasoning to bound."""

    def __init__(self, tokenizer: Tokenizer, budget: int, inner: Constraint | None = None, marks: Marks = THINK):
        self.tokenizer, self.inner, self.marks = tokenizer, inner, marks
        self.left = budget
        self.close = tokenizer.encode(marks.close)
        self.forcing: list[int] = tokenizer.encode(marks.header + marks.close) if budget == 0 else []
        self.closed = False
        self.head = None if not marks.header else ""  # the answer's first header, until it is complete
        self.tail = ""  # the last characters of the reasoning, where a close of its own shows

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.forcing:
            logits.fill(-np.inf)
            logits[self.forcing[0]] = 0.0
            return logits
        return logits if self.inner is None else self.inner.mask(logits)

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
        if self.closed:
            return
        if self.forcing:
            self.forcing.pop(0)
            self.closed = not self.forcing
            return
        text = self.tokenizer.decode([token])
        if self.head is not None:  # reasoning only behind its header (harmony: the analysis channel's)
            self.head += text
            if self.head.startswith(self.marks.header):
                self.head = None
            elif not self.marks.header.startswith(self.head):
                self.closed = True
            return
        text = self.tail + text
        if self.marks.end in text:
            self.closed = True
            return
        self.tail = text[-len(self.marks.end):]
        self.left -= 1
        if self.left <= 0:
            self.forcing = list(self.close)
