"""Images in chat prompts: the synthetic Qwen3.5 (real vocabulary and template) with its tiny tower.
Each image's one placeholder becomes its tokens, message ends move past them, prefills are never
cut inside an image, and a conversation carries its images from turn to turn."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pagelm.chat.conversation import Conversation
from pagelm.chat.model import ChatModel
from pagelm.errors import ImageError, PagelmError
from pagelm.engine.sampling import SamplingParams
from pagelm.tools.synth_tower import SHAPES, write_mmproj
from pagelm.vision.inputs import IMAGE_PAD, VISION_END, VISION_START

IM_START = 248_045


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def chat(qwen35_chat_gguf, tmp_path_factory) -> ChatModel:
    tower = str(tmp_path_factory.mktemp("tower") / "mmproj.gguf")
    write_mmproj(tower, SHAPES["qwen3.5-tiny-chat"], seed=1)
    return ChatModel.open(qwen35_chat_gguf, mmproj=tower, dtype="float32")


def _messages(content) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content},
            {"role": "assistant", "content": "A square."}, {"role": "user", "content": "And its colour?"}]


def test_an_image_placeholder_becomes_the_images_tokens(chat):
    image = chat.prepare_image(png(40, 40))
    assert image.tokens == 64  # small images are resized up to the minimum, 64 tokens
    parts = [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]
    prompt = chat.chat_prompt(_messages(parts), think=False, images=[image])
    text_only = chat.chat_prompt(_messages("What shape is this?"), think=False)
    (placed,) = prompt.images
    assert prompt.tokens[placed.start - 1] == VISION_START and prompt.tokens[placed.end] == VISION_END
    assert prompt.tokens[placed.start:placed.end] == [IMAGE_PAD] * 64
    assert len(prompt.tokens) == len(text_only.tokens) + 64 + 2
    # every message end is where a turn starts, the ones after the image moved past its tokens
    assert len(prompt.boundaries) == len(text_only.boundaries) >= 3
    assert prompt.boundaries[0] == text_only.boundaries[0] < placed.start
    assert [b - 66 for b in prompt.boundaries[1:]] == text_only.boundaries[1:]
    assert all(prompt.tokens[b] == IM_START for b in prompt.boundaries)
    assert prompt.cuts_image(placed.start + 1) and not prompt.cuts_image(placed.start)
    assert not prompt.cuts_image(placed.end)
    assert prompt.images_in(0, placed.start) == [] and prompt.images_in(placed.start, placed.end) == [image]
    answered = prompt.answered("", "Red.")
    assert answered.images == prompt.images and answered.image_keys == [image.key]


def test_the_same_pixels_give_the_same_key(chat):
    a, again = chat.prepare_image(png(40, 40)), chat.prepare_image(png(40, 40))
    other = chat.prepare_image(png(40, 40, seed=1))
    assert a.key == again.key != other.key
    webp = io.BytesIO()
    Image.open(io.BytesIO(png(40, 40))).save(webp, "WEBP", lossless=True)
    assert chat.prepare_image(webp.getvalue()).key == a.key  # the pixels, not the file, make the key


def test_placeholders_must_match_the_images(chat):
    image = chat.prepare_image(png(40, 40))
    with pytest.raises(PagelmError, match="1 image placeholder"):
        chat.chat_prompt([{"role": "user", "content": "typed <|image_pad|> by hand"}])
    with pytest.raises(PagelmError, match="0 image placeholder"):
        chat.chat_prompt([{"role": "user", "content": "no picture here"}], images=[image])
    with pytest.raises(ImageError, match="not a PNG"):
        chat.prepare_image(b"hello")


def test_a_conversation_carries_its_images(chat):
    conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=1024)
    image = chat.prepare_image(png(40, 40))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    list(conversation.ask("What shape?", params, images=[image]))
    assert conversation.session.images == [image.key] and conversation.last.prompt_tokens > 66
    list(conversation.ask("And its colour?", params))
    # the history's image is in the second turn's prompt (Qwen3.5 renders a past answer without its
    # think block, so the held tokens are no prefix of it: all is prefilled again, image included)
    assert conversation.images == [image] and conversation.session.images == [image.key]
    assert conversation.last.prompt_tokens > 66
    with pytest.raises(PagelmError, match="image placeholder"):
        list(conversation.ask("a <|image_pad|> typed by hand", params))
    assert len(conversation.messages) == 4 and conversation.images == [image]
