"""A model ready to chat: engine model, tokenizer and chat template opened together, and
messages turned into prompt tokens with the positions where each message ends.

Images (`vision.inputs.ImageInput`, made by `prepare_image`) join the prompt where the template
writes their placeholder, one `<|image_pad|>` expanded to the image's token count.

The message boundaries are where a prefix cache can checkpoint: the next turn of the same
conversation, or another one with the same system prompt, starts with exactly those tokens.
They are found after every message, not just the last few (from one marked render, see
`boundaries`): the server cuts prefill at them, and a prefix must be cut at the same places
whichever request computes it, or the arithmetic (and with it a greedy answer) can differ between
a restored state and a recomputed one. For the same reason a chat prompt can render its answer as
the next request will (`Prompt.answered`), cut at the same places, for the server to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Callable, Sequence

from pagelm.chat.boundaries import MessageEnds
from pagelm.chat.harmony import HarmonySplitter, is_harmony
from pagelm.chat.reasoning import ReasoningSplitter
from pagelm.chat.template import ChatTemplate
from pagelm.chat.tokenizer import Tokenizer
from pagelm.chat.tools import Tool, ToolFormat, tool_format
from pagelm.engine.load import load_model
from pagelm.engine.model import DEFAULT_IMAGE_CACHE_MIB, Model
from pagelm.runtime import heap
from pagelm.errors import PagelmError
from pagelm.measure.memory import read_memory
from pagelm.vision.inputs import ImageInput, PlacedImage, expand_images, prepare_image
from pagelm.vision.preprocess import DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS
from pagelm.weights import EmbeddingMode
from pagelm.weights.loader import WeightsMode


# reasoning efforts a request may ask for (OpenAI's `reasoning_effort`, Ollama's `think`): thinking on,
# and for a template that reads one (gpt-oss's `reasoning_effort`) that effort
EFFORTS = ("low", "medium", "high")


@dataclass
class Prompt:
    """Tokens to generate from, the positions worth a checkpoint (where messages end), whether the
    answer starts inside a reasoning block, and for a chat `answered(reasoning, content)`: the
    conversation with that answer, as the next request will render it, up to the answer's end;
    the images among the tokens, where each starts."""

    tokens: list[int]
    boundaries: list[int] = field(default_factory=list)
    think_open: bool = False
    split_reasoning: bool = True
    harmony: bool = False  # the answer is harmony messages (chat.harmony): reasoning on the analysis channel
    answered: Callable[[str, str], Prompt | None] | None = None
    images: list[PlacedImage] = field(default_factory=list)

    def splitter(self) -> ReasoningSplitter | HarmonySplitter:
        """What splits this prompt's answer into reasoning and content as it streams."""
        return HarmonySplitter() if self.harmony else ReasoningSplitter(self.think_open)

    @property
    def image_keys(self) -> list[str]:
        return [p.image.key for p in self.images]

    def images_in(self, lo: int, hi: int) -> list[ImageInput]:
        """The images whose tokens start in tokens[lo:hi]."""
        return [p.image for p in self.images if lo <= p.start < hi]

    def cuts_image(self, at: int) -> bool:
        """Whether a prefill cut before token `at` would fall inside an image's tokens."""
        return any(p.start < at < p.end for p in self.images)


@dataclass
class ChatModel:
    name: str
    path: Path
    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate
    tokenizer_anonymous_bytes: int = 0  # what building the tokenizer added to anonymous memory
    image_min_tokens: int = DEFAULT_MIN_TOKENS  # the bounds an image is resized within
    image_max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def open(cls, path: str | Path, name: str | None = None, embedding: EmbeddingMode = "mapped",
             weights: WeightsMode = "mapped", dtype: str = "bfloat16", threads: int | None = None,
             mmproj: str | None = None, image_cache_mib: int = DEFAULT_IMAGE_CACHE_MIB,
             image_tokens: tuple[int, int] = (DEFAULT_MIN_TOKENS, DEFAULT_MAX_TOKENS)) -> ChatModel:
        """`image_tokens`: the (min, max) token counts an image is resized within."""
        if not 1 <= image_tokens[0] <= image_tokens[1]:
            raise PagelmError(f"image token bounds {image_tokens[0]}..{image_tokens[1]}: expected 1 <= min <= max")
        path = Path(path)
        name = name or (path.name if path.is_dir() else path.stem)
        model = load_model(str(path), embedding=embedding, weights=weights, dtype=dtype, threads=threads, mmproj=mmproj,
                           image_cache_mib=image_cache_mib)
        before = read_memory().anonymous
        tokenizer = Tokenizer.open(model.file)
        heap.trim()
        tokenizer_bytes = max(0, read_memory().anonymous - before)

        def text_of(token_id: int | None) -> str:
            return "" if token_id is None else tokenizer.decode([token_id], skip_special=False)

        template = ChatTemplate(model.file.metadata.get("tokenizer.chat_template"), name=name,
                                bos_token=text_of(tokenizer.bos_id),
                                eos_token=text_of(tokenizer.eos_ids[0] if tokenizer.eos_ids else None))
        return cls(name, path, model, tokenizer, template, tokenizer_bytes, *image_tokens)

    def open_draft(self, path: str | Path, weights: WeightsMode = "mapped", dtype: str = "bfloat16",
                   threads: int | None = None) -> Model:
        """A draft model for speculation (engine.speculate.DraftModel), weights mapped as `weights`
        says; PagelmError where its vocabulary is not this model's, token for token."""
        draft = load_model(str(path), weights=weights, dtype=dtype, threads=threads)
        theirs = Tokenizer.open(draft.file)
        ours = self.tokenizer
        if theirs.vocab_size != ours.vocab_size:
            raise PagelmError(f"draft model {path}: a vocabulary of {theirs.vocab_size} tokens, {self.name}'s has "
                              f"{ours.vocab_size}: a draft model must share the model's vocabulary")
        differing = next((i for i in range(ours.vocab_size) if theirs.id_to_token(i) != ours.id_to_token(i)), None)
        if differing is not None:
            raise PagelmError(f"draft model {path}: token {differing} is {theirs.id_to_token(differing)!r} there and "
                              f"{ours.id_to_token(differing)!r} in {self.name}: a draft model must share the "
                              f"model's vocabulary")
        return draft

    @property
    def architecture(self) -> str:
        return self.model.file.require("general.architecture")

    @property
    def thinks(self) -> bool:
        """Whether the template opens a reasoning block when thinking is asked for (harmony's answers
        always reason first)."""
        return self.harmony or self.template.think_open(enable_thinking=True)

    @cached_property
    def harmony(self) -> bool:
        return is_harmony(self.template.source)

    @cached_property
    def message_ends(self) -> MessageEnds:
        return MessageEnds(self.template)

    @cached_property
    def tool_form(self) -> ToolFormat | None:
        """How the template writes tool calls; None when it renders none."""
        return tool_format(self.template.source)

    def prepare_image(self, data: bytes) -> ImageInput:
        """An encoded image made ready for this model's tower; ImageError names what is wrong with it."""
        if self.model.tower is None:
            raise PagelmError(f"model '{self.name}' has no vision support (no vision tower): it cannot read images")
        return prepare_image(data, self.model.tower.config, self.image_min_tokens, self.image_max_tokens)

    def chat_prompt(self, messages: list[dict], think: bool | str | None = None, tools: list[dict] | None = None,
                    images: Sequence[ImageInput] = ()) -> Prompt:
        """Render `messages` (and the `tools` offered, in the template's function form) with the
        generation prompt; `think` None leaves the template's default, an effort (EFFORTS) is thinking
        on at that effort where the template reads one. `images` are those of the
        messages' image parts, in order."""
        tokens, ends, text, placed = self._render(messages, think, tools, images)
        return Prompt(tokens, sorted({n for n in ends if n is not None}), think_open=self.template.think_prefix(text),
                      answered=partial(self._answered, messages, think, tools, images), images=placed,
                      harmony=self.harmony)

    def _render(self, messages: list[dict], think: bool | str | None, tools: list[dict] | None,
                images: Sequence[ImageInput] = ()):
        """(prompt tokens, per message the token count where it ends or None, prompt text, images placed)."""
        args = dict(add_generation_prompt=True, enable_thinking=None if think is None else bool(think), tools=tools)
        if isinstance(think, str):
            args["reasoning_effort"] = think
        if self.harmony:  # gpt-oss's template reads an assistant message's reasoning as `thinking`
            messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
        text = self.template.render(messages, **args)
        tokens = self.tokenizer.encode(text, add_special=True)
        ends = self.message_ends.token_ends(self.message_ends.text_ends(messages, text, **args), text, tokens,
                                           self.tokenizer)
        if self.model.tower is None:
            return tokens, ends, text, []
        expanded = expand_images(tokens, images)
        return expanded.tokens, [None if e is None else expanded.index(e) for e in ends], text, expanded.images

    def _answered(self, messages: list[dict], think: bool | str | None, tools: list[dict] | None,
                  images: Sequence[ImageInput], reasoning: str, content: str) -> Prompt | None:
        """The conversation with this answer appended, as the next request (a user message after
        it) renders it, up to the answer's end: its tokens and message ends; None when the answer
        gets no end."""
        answer = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
        follow = {"role": "user", "content": "?"}
        calls = self._tool_calls(content, tools)
        if calls:  # what the client sends back: the calls as structured messages, then their results
            answer["content"], answer["tool_calls"] = calls
            follow = {"role": "tool", "content": "?"}
        try:
            tokens, ends, _, placed = self._render([*messages, answer, follow], think, tools, images)
        except PagelmError:
            return None
        end = ends[len(messages)]
        if end is None:
            return None
        return Prompt(tokens[:end], sorted({n for n in ends[:len(messages)] if n is not None and n < end}) + [end],
                      images=[p for p in placed if p.end <= end])

    def _tool_calls(self, content: str, tools: list[dict] | None) -> tuple[str, list[dict]] | None:
        """(the text, the calls as a request's assistant message carries them) of an answer that
        calls tools in the template's form; None when it calls none."""
        if not tools or self.tool_form is None:
            return None
        stream = self.tool_form.stream([Tool(t["function"]["name"], parameters=t["function"].get("parameters") or {})
                                        for t in tools])
        pieces = stream.push(content) + stream.finish()
        if not stream.calls:
            return None
        text = "".join(p for p in pieces if isinstance(p, str))
        return text, [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for c in stream.calls]

    def raw_prompt(self, text: str) -> Prompt:
        """Plain text completion: no template, no reasoning split."""
        return Prompt(self.tokenizer.encode(text, add_special=True), split_reasoning=False)
