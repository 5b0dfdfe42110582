"""Where each message of a rendered conversation ends, in prompt tokens, from one extra render.

The chat template is compiled a second time with a mark written at the start of each iteration
of its loop over the messages (`messages`, or `loop_messages` as HF templates call them without a
leading system message) and one right after that loop. Rendering a conversation with it and taking
the marks out must give the prompt text exactly, or no message gets an end. Message k ends where
iteration k + 1 starts, the last one where the loop ends: where the conversation renders it with
what follows it, so a past answer ends where Qwen3.5's template writes it without its think block.

An end counts only where a special token of the prompt starts (the next turn's `<|im_start|>`, or
the generation prompt's). The tokenizer matches special tokens before it splits the text between
them, so when every occurrence of that token's text in the prompt became that token, the text
before it encodes to exactly the prompt's tokens before it. A message whose text runs on into the
next one's (Qwen3.5's consecutive tool results share one user turn) gets no end, and neither does
any message of a template without such a loop (its prompts are checkpointed only every
`--checkpoint-interval` tokens).
"""

from __future__ import annotations

import re
from typing import Sequence

from pagelm.chat.template import ChatTemplate, TemplateError
from pagelm.chat.tokenizer import Tokenizer

_BASE = 0xF0000  # marks are private-use characters: loop i starts with _BASE + 2i, ends with _BASE + 2i + 1
_MARK = re.compile("[\U000F0000-\U000F00FF]")
_TAG = re.compile(r"\{%([-+]?)\s*(for|endfor)\b(.*?)([-+]?)%\}", re.S)
_OVER_MESSAGES = re.compile(r"\s*\w+\s+in\s+(?:loop_)?messages\s*")


def marked_source(source: str) -> tuple[str, int]:
    """`source` with marks in its loops over the messages (at most 64 loops), and how many it marked."""
    parts, pos, open_loops, loops = [], 0, [], 0
    for tag in _TAG.finditer(source):
        _, keyword, rest, trail = tag.groups()
        if keyword == "for":
            marked = loops < 64 and _OVER_MESSAGES.fullmatch(rest) is not None
            open_loops.append(loops if marked else None)
            if not marked:
                continue
            loops += 1
            mark = chr(_BASE + 2 * (loops - 1))
        else:
            if not open_loops:
                return source, 0
            loop = open_loops.pop()
            if loop is None:
                continue
            mark = chr(_BASE + 2 * loop + 1)
        # a block tag, so the whitespace control after the original tag (its own or trim_blocks)
        # applies to the text after the mark just as it applied to the text after the tag
        parts += [source[pos:tag.end()], f"{{% if true %}}{mark}{{% endif {trail}%}}"]
        pos = tag.end()
    return "".join(parts) + source[pos:], loops


class MessageEnds:
    """A chat template's message ends: `text_ends` in the rendered text, `token_ends` in its tokens."""

    def __init__(self, template: ChatTemplate):
        source, loops = marked_source(template.source)
        self._marked = None
        if loops:
            try:
                self._marked = ChatTemplate(source, template.bos_token, template.eos_token, template.name,
                                            max_output=template.max_output, max_steps=template.max_steps,
                                            timeout_s=template.timeout_s)
            except TemplateError:
                pass

    def text_ends(self, messages: Sequence[dict], text: str, **render_args) -> list[int | None]:
        """Per message, the offset in `text` (the conversation rendered with `render_args`) where it ends."""
        none: list[int | None] = [None] * len(messages)
        if self._marked is None or _MARK.search(text):
            return none
        try:
            marked = self._marked.render(messages, **render_args)
        except TemplateError:
            return none
        starts: dict[int, list[int]] = {}
        ends: dict[int, list[int]] = {}
        for n, mark in enumerate(_MARK.finditer(marked)):
            code = ord(mark.group()) - _BASE
            (ends if code % 2 else starts).setdefault(code // 2, []).append(mark.start() - n)
        if _MARK.sub("", marked) != text:
            return none
        best = None  # the loop that renders the conversation: it ran once and spans the most text
        for loop, begun in starts.items():
            skipped = len(messages) - len(begun)
            leading_system = skipped == 1 and messages[0].get("role") == "system"
            if len(ends.get(loop, ())) != 1 or not (skipped == 0 or leading_system):
                continue
            span = ends[loop][0] - begun[0]
            if best is None or span > best[0]:
                best = (span, [begun[0]] * skipped + begun[1:] + ends[loop])
        return none if best is None else best[1]

    @staticmethod
    def token_ends(text_ends: Sequence[int | None], text: str, tokens: Sequence[int],
                   tokenizer: Tokenizer) -> list[int | None]:
        """`text_ends` as token counts of `tokens` (`text` encoded with add_special), where a special
        token starts and before the last token; None elsewhere."""
        if tokenizer.add_eos and tokenizer.eos_id is not None:  # a text encoded alone would end with EOS
            return [None] * len(text_ends)
        at = _special_starts(text, tokens, tokenizer)
        return [n if (n := at.get(end)) is not None and 0 < n < len(tokens) else None for end in text_ends]


def _special_starts(text: str, tokens: Sequence[int], tokenizer: Tokenizer) -> dict[int, int]:
    """Text offset → token index of each special token whose every occurrence in `text` it is."""
    where: dict[int, list[int]] = {}
    for i, token in enumerate(tokens):
        if tokenizer.is_special(token):
            where.setdefault(token, []).append(i)
    starts = {}
    for token, indices in where.items():
        spelled = tokenizer.decode([token], skip_special=False)
        offsets, i = [], text.find(spelled) if spelled else -1
        while i >= 0:
            offsets.append(i)
            i = text.find(spelled, i + 1)
        if len(offsets) == len(indices):  # else some occurrence was not matched as this token
            starts.update(zip(offsets, indices))
    return starts
