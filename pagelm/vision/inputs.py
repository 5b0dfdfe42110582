"""Images as a prompt carries them: decoded once, keyed by content, placed at their pad tokens.

Owns Qwen3.5's image token ids, `ImageInput` (an image decoded and resized once, when a request
arrives, so that what waits for the engine is bounded by the token cap; its content key; pixel
rows made only when the tower needs them) and expanding each image's one `<|image_pad|>` of a
rendered prompt to the image's token count. Never runs the tower (`vision.tower`) and never
renders templates (`chat`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagelm.errors import PagelmError
from pagelm.vision.mmproj import VisionConfig
from pagelm.vision.preprocess import (DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS, MAX_DECODED_PIXELS, PixelRows,
                                      decode_image, pixel_rows, resized_pixels, to_rgb)

VISION_START = 248_053
VISION_END = 248_054
IMAGE_PAD = 248_056  # the chat template writes one per image; it stands for all the image's tokens


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its resized RGB pixels and `key`, a hash of the decoded pixels and
    of the resize parameters (equal keys: equal rows, equal embeddings)."""

    pixels: np.ndarray  # (height, width, 3) uint8, resized for the tower
    config: VisionConfig
    key: str

    @property
    def grid(self) -> tuple[int, int, int]:
        """(1, patch rows, patch columns)."""
        patch = self.config.patch_size
        return 1, self.pixels.shape[0] // patch, self.pixels.shape[1] // patch

    @property
    def merged(self) -> tuple[int, int]:
        """(rows, columns) of the image's tokens."""
        m = self.config.merge_size
        return self.grid[1] // m, self.grid[2] // m

    @property
    def tokens(self) -> int:
        rows, columns = self.merged
        return rows * columns

    def rows(self) -> PixelRows:
        c = self.config
        return pixel_rows(self.pixels, c.patch_size, c.merge_size, c.image_mean, c.image_std)


def prepare_image(data: bytes, config: VisionConfig, min_tokens: int = DEFAULT_MIN_TOKENS,
                  max_tokens: int = DEFAULT_MAX_TOKENS, max_decoded_pixels: int = MAX_DECODED_PIXELS) -> ImageInput:
    """Decode an encoded image (PNG, JPEG, WebP, GIF) for `config`'s tower; ImageError names what is wrong."""
    rgb = to_rgb(decode_image(data, max_decoded_pixels))
    resized = resized_pixels(rgb, min_tokens, max_tokens, config.patch_size * config.merge_size)
    decoded = np.asarray(rgb)
    digest = hashlib.blake2b(decoded.tobytes(), digest_size=16)
    digest.update(repr((decoded.shape, min_tokens, max_tokens, config.patch_size, config.merge_size,
                        config.image_mean, config.image_std)).encode())
    return ImageInput(resized, config, digest.hexdigest())


@dataclass(frozen=True)
class PlacedImage:
    """An image and the index of its first pad token in a prompt."""

    start: int
    image: ImageInput

    @property
    def end(self) -> int:
        return self.start + self.image.tokens


@dataclass(frozen=True)
class ExpandedPrompt:
    """A prompt whose image placeholders were expanded: its tokens, where each image lies in them,
    and where each image's one placeholder was before."""

    tokens: list[int]
    images: list[PlacedImage]
    placeholders: list[int]

    def index(self, i: int) -> int:
        """Where token i of the prompt before expansion (or the end, i = its length) lies in `tokens`."""
        return i + sum(p.image.tokens - 1 for at, p in zip(self.placeholders, self.images) if at < i)


def expand_images(tokens: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
    """The prompt with each `<|image_pad|>` repeated to its image's token count (images in order)."""
    placeholders = [i for i, t in enumerate(tokens) if t == IMAGE_PAD]
    if len(placeholders) != len(images):
        raise PagelmError(f"the prompt has {len(placeholders)} image placeholder(s) for {len(images)} image(s)")
    out: list[int] = []
    placed = []
    at = 0
    for pad, image in zip(placeholders, images):
        out += list(tokens[at:pad])
        placed.append(PlacedImage(len(out), image))
        out += [IMAGE_PAD] * image.tokens
        at = pad + 1
    return ExpandedPrompt(out + list(tokens[at:]), placed, placeholders)
