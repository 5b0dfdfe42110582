"""A conversation over a model: messages → chat template → tokens → generation → reasoning/content.

Owns the turn loop and the reuse of the already-processed prompt prefix; sampling and compute
belong to the engine, text ↔ tokens to the tokenizer, rendering to the template.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator, Sequence

from pagelm.chat.budget import answer_constraint
from pagelm.chat.harmony import HarmonySplitter, is_harmony
from pagelm.chat.reasoning import ReasoningSplitter
from pagelm.chat.template import ChatTemplate
from pagelm.chat.tokenizer import StreamDecoder, Tokenizer
from pagelm.engine.model import Model
from pagelm.errors import PagelmError
from pagelm.engine.sampling import SamplingParams
from pagelm.engine.speculate import DraftModel, SpeculationStats, Speculator, check_mode
from pagelm.vision.inputs import ExpandedPrompt, ImageInput, expand_images

if TYPE_CHECKING:
    from pagelm.chat.grammar import Grammar


@dataclass
class Turn:
    """One answered message: the split text, the generated ids and what it cost."""

    content: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "stop"
    speculation: SpeculationStats | None = None  # drafted and accepted tokens, where drafts were tried

    @property
    def prompt_tok_s(self) -> float:
        new = self.prompt_tokens - self.reused_tokens
        return new / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s and len(self.token_ids) > 1 else 0.0


class Conversation:
    """Chat history plus one engine session whose state is reused whenever the next rendered
    prompt starts with everything the session has already processed."""

    def __init__(self, model: Model, tokenizer: Tokenizer, template: ChatTemplate, max_len: int = 4096,
                 system: str | None = None, think: bool = False, speculate: str = "auto", draft: Model | None = None):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.max_len = max_len
        check_mode(speculate, model)
        self.speculate = speculate  # engine.speculate.MODES: the same answers, drafts checked or not
        # drafts from a smaller model (ChatModel.open_draft), whose session follows the conversation
        self.draft = None if draft is None or speculate == "off" else DraftModel.of(draft, model.head.vocab_size, max_len)
        self.system = system
        self.think = think
        self.messages: list[dict] = []
        self.images: list[ImageInput] = []  # those of the messages, in order
        self.session = model.session(max_len)
        self.last: Turn | None = None

    def clear(self) -> None:
        self.messages = []
        self.images = []

    def _prompt(self) -> ExpandedPrompt:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        text = self.template.render(messages, add_generation_prompt=True, enable_thinking=self.think)
        tokens = self.tokenizer.encode(text, add_special=True)
        return ExpandedPrompt(tokens, [], []) if self.model.tower is None else expand_images(tokens, self.images)

    def _reuse_or_reset(self, prompt: ExpandedPrompt) -> int:
        held = self.session.tokens
        keys = [p.image.key for p in prompt.images]
        if (len(held) < len(prompt.tokens) and prompt.tokens[: len(held)] == held
                and keys[: len(self.session.images)] == self.session.images):
            return len(held)
        self.session = self.model.session(self.max_len)
        return 0

    def ask(self, text: str, params: SamplingParams = SamplingParams(),
            cancel: threading.Event | None = None, grammar: Grammar | None = None,
            images: Sequence[ImageInput] = ()) -> Iterator[tuple[str, str]]:
        """Add a user message (`images` first, then `text`) and stream the answer as
        (reasoning_delta, content_delta) pairs. The finished turn is in `self.last`; the
        assistant message joins the history. `grammar` constrains the answer (the content:
        reasoning, when thinking, stays free)."""
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}] if images else text
        self.messages.append({"role": "user", "content": content})
        self.images += images
        try:
            expanded = self._prompt()
            if len(expanded.tokens) >= self.max_len:
                raise PagelmError(f"prompt of {len(expanded.tokens)} tokens does not fit the context of {self.max_len}")
        except PagelmError:  # the message is not asked: out of the history again
            self.messages.pop()
            del self.images[len(self.images) - len(images):]
            raise
        prompt = expanded.tokens
        turn = Turn(prompt_tokens=len(prompt))
        turn.reused_tokens = self._reuse_or_reset(expanded)
        stops = tuple(params.stop_tokens) + self.tokenizer.eos_ids
        params = replace(params, stop_tokens=stops, max_tokens=min(params.max_tokens, self.max_len - len(prompt)))
        think_open = self.template.think_open(prompt_text=None, enable_thinking=self.think)
        harmony = is_harmony(self.template.source)
        splitter = HarmonySplitter() if harmony else ReasoningSplitter(think_open=think_open)
        constraint = answer_constraint(self.tokenizer, grammar, think_open, params.max_tokens, params.reasoning_budget,
                                       harmony)
        decoder = StreamDecoder(self.tokenizer)
        start = time.perf_counter()
        new_images = [p.image for p in expanded.images if p.start >= turn.reused_tokens]
        speculator = Speculator.of(self.speculate, self.draft, self.session)
        turn.speculation = None if speculator is None else speculator.stats
        for token in self.session.generate(prompt[turn.reused_tokens:], params, cancel=cancel, constraint=constraint,
                                           images=new_images, speculate=speculator or "off"):
            if not turn.token_ids:
                turn.prefill_s = time.perf_counter() - start
                start = time.perf_counter()
            turn.token_ids.append(token)
            if token in stops:
                break
            reasoning, content = splitter.push(decoder.push(token))
            turn.reasoning += reasoning
            turn.content += content
            if reasoning or content:
                yield reasoning, content
        turn.decode_s = time.perf_counter() - start
        if cancel is not None and cancel.is_set():
            turn.finish_reason = "cancelled"
        elif not turn.token_ids or turn.token_ids[-1] not in stops:
            turn.finish_reason = "length"
        reasoning, content = splitter.finish()
        turn.reasoning += reasoning
        turn.content += content
        if reasoning or content:
            yield reasoning, content
        self.messages.append({"role": "assistant", "content": turn.content})
        self.last = turn
