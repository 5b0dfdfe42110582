"""A model ready to chat: engine model, tokenizer and chat template opened together, and
messages turned into prompt tokens with the positions where each message ends.

The message boundaries are where a prefix cache can checkpoint: the next turn of the same
conversation, or another one with the same system prompt, starts with exactly those tokens.
They are found after every message, not just the last few: the server cuts prefill at them, and
a prefix must be cut at the same places whichever request computes it, or the arithmetic (and
with it a greedy answer) can differ between a restored state and a recomputed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagelm.chat.template import ChatTemplate, TemplateError
from pagelm.chat.tokenizer import Tokenizer
from pagelm.engine import Model
from pagelm import heap
from pagelm.measure.memory import read_memory
from pagelm.weights import EmbeddingMode
from pagelm.weights.loader import WeightsMode


@dataclass
class Prompt:
    """Tokens to generate from, the positions worth a checkpoint, and whether the answer starts
    inside a reasoning block."""

    tokens: list[int]
    boundaries: list[int] = field(default_factory=list)
    think_open: bool = False
    split_reasoning: bool = True


@dataclass
class ChatModel:
    name: str
    path: Path
    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate
    tokenizer_anonymous_bytes: int = 0  # what building the tokenizer added to anonymous memory

    @classmethod
    def open(cls, path: str | Path, name: str | None = None, embedding: EmbeddingMode = "mapped",
             weights: WeightsMode = "mapped", dtype: str = "bfloat16", threads: int | None = None) -> ChatModel:
        path = Path(path)
        name = name or path.stem
        model = Model(str(path), embedding=embedding, weights=weights, dtype=dtype, threads=threads)
        before = read_memory().anonymous
        tokenizer = Tokenizer.from_gguf(model.file)
        heap.trim()
        tokenizer_bytes = max(0, read_memory().anonymous - before)

        def text_of(token_id: int | None) -> str:
            return "" if token_id is None else tokenizer.decode([token_id], skip_special=False)

        template = ChatTemplate(model.file.metadata.get("tokenizer.chat_template"), name=name,
                                bos_token=text_of(tokenizer.bos_id),
                                eos_token=text_of(tokenizer.eos_ids[0] if tokenizer.eos_ids else None))
        return cls(name, path, model, tokenizer, template, tokenizer_bytes)

    @property
    def architecture(self) -> str:
        return self.model.file.require("general.architecture")

    @property
    def thinks(self) -> bool:
        """Whether the template opens a reasoning block when thinking is asked for."""
        return self.template.think_open(enable_thinking=True)

    def chat_prompt(self, messages: list[dict], think: bool | None = None, tools: list[dict] | None = None) -> Prompt:
        """Render `messages` (and the `tools` offered, in the template's function form) with the
        generation prompt; `think` None leaves the template's default."""
        text = self.template.render(messages, add_generation_prompt=True, enable_thinking=think, tools=tools)
        tokens = self.tokenizer.encode(text, add_special=True)
        boundaries = []
        for k in range(len(messages)):
            try:
                part = self.template.render(messages[: k + 1], add_generation_prompt=False, enable_thinking=think,
                                            tools=tools)
            except TemplateError:
                # a template that refuses a conversation without a user message (Qwen's): the
                # boundary is where this prompt and one going on with another user message part
                try:
                    other = self.template.render(messages[: k + 1] + [{"role": "user", "content": "\x00"}],
                                                 add_generation_prompt=False, enable_thinking=think, tools=tools)
                except TemplateError:
                    continue
                ids = self.tokenizer.encode(other, add_special=True)
                common = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
                if 0 < common < len(tokens):
                    boundaries.append(common)
                continue
            if not part or not text.startswith(part):
                continue
            ids = self.tokenizer.encode(part, add_special=True)
            if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids:
                boundaries.append(len(ids))
        return Prompt(tokens, sorted(set(boundaries)), think_open=self.template.think_prefix(text))

    def raw_prompt(self, text: str) -> Prompt:
        """Plain text completion: no template, no reasoning split."""
        return Prompt(self.tokenizer.encode(text, add_special=True), split_reasoning=False)
