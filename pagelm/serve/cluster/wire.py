"""What crosses from the ingress to an engine replica for one request: the prompt and settings of
a Job without anything that holds the ingress's model, and the prefix hashes the router reads.

A Job's grammar travels as the (kind, text) it was compiled from, its `answered` rendering as the
arguments of ChatModel._answered: the replica compiles and renders with its own model.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from functools import partial

from pagelm.chat.model import ChatModel, Prompt
from pagelm.engine.sampling import SamplingParams


@dataclass
class WireJob:
    tokens: list[int]
    boundaries: list[int]
    think_open: bool
    split_reasoning: bool
    harmony: bool
    images: list
    answered_args: tuple | None  # (messages, think, tools, images) of a chat prompt
    params: SamplingParams
    stop: tuple[str, ...]
    max_len: int | None
    request_id: str
    grammar: tuple[str, str] | None  # (kind, text) for Server.grammar

    @classmethod
    def of(cls, job, grammar: tuple[str, str] | None) -> WireJob:
        p = job.prompt
        # ChatModel.chat_prompt makes `answered` a partial of its own _answered; the arguments
        # are plain data, the bound model is not
        args = p.answered.args if isinstance(p.answered, partial) else None
        return cls(list(p.tokens), list(p.boundaries), p.think_open, p.split_reasoning, p.harmony, list(p.images), args,
                   job.params, tuple(job.stop), job.max_len, job.id, grammar)

    def prompt(self, chat: ChatModel) -> Prompt:
        answered = None if self.answered_args is None else partial(chat._answered, *self.answered_args)
        return Prompt(self.tokens, self.boundaries, self.think_open, self.split_reasoning, answered=answered,
                      images=self.images, harmony=self.harmony)


def prefix_hashes(prompt: Prompt) -> list[str]:
    """Chained hashes of the prompt's prefixes at its message boundaries (where the prefix cache
    checkpoints), shortest first: equal hashes, equal tokens and images up to that boundary."""
    h, out, start = hashlib.blake2b(digest_size=12), [], 0
    for end in prompt.boundaries:
        h.update(array("q", prompt.tokens[start:end]).tobytes())
        for placed in prompt.images:
            if start <= placed.start < end:
                h.update(placed.image.key.encode())
        out.append(h.hexdigest())
        start = end
    return out
