"""Images into the pixel rows Qwen3.5's vision tower reads, exactly as transformers' Qwen2-VL image
processor (its PIL backend, the one that needs no torchvision) makes them.

Owns decoding (Pillow: PNG, JPEG, WebP, GIF's first frame; EXIF orientation applied as
transformers' `load_image` does), the limits on what an image may be (checked on the header,
before any pixel is decoded), smart_resize, bicubic resampling, normalisation and the
merge-block order of patches. Never runs the tower.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from pagelm.errors import ImageError, PagelmError
from pagelm.vision.mmproj import CHANNELS, TEMPORAL_PATCH

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_ASPECT = 200  # transformers' smart_resize refuses longer / shorter above this
# Decoded pixels allowed before a single one is decoded: a 50 MP photo is 150 MB of RGB.
MAX_DECODED_PIXELS = 50_000_000
DEFAULT_MIN_TOKENS = 64  # transformers' min_pixels for Qwen3.5 (65,536 = 64 tokens of 32 × 32 pixels)
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class PixelRows:
    rows: np.ndarray  # (patches, channels · 2 frames · patch²) float32, merge-block order
    grid: tuple[int, int, int]  # (1, patch rows, patch columns)
    merge_size: int

    @property
    def tokens(self) -> int:
        """Image tokens the tower makes of these rows."""
        return self.grid[1] * self.grid[2] // self.merge_size**2


def check_size(width: int, height: int, max_pixels: int = MAX_DECODED_PIXELS) -> None:
    """Refuse an image by its header's size: empty, over `max_pixels`, or over MAX_ASPECT : 1."""
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width} × {height} pixels; expected at least 1 × 1")
    if width * height > max_pixels:
        raise ImageError(f"the image is {width} × {height} = {width * height:,} pixels, over the limit of "
                         f"{max_pixels:,} decoded pixels")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise ImageError(f"the image is {width} × {height} pixels: an aspect ratio over {MAX_ASPECT}:1")


def _signature_format(data: bytes) -> str | None:
    """The format the file's first bytes announce (Pillow refuses a bad header without saying why)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def decode_image(data: bytes, max_pixels: int = MAX_DECODED_PIXELS) -> Image.Image:
    """The decoded, upright image (GIF: its first frame), in the mode the file stores."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.UnidentifiedImageError:
        fmt = _signature_format(data)
        if fmt is None:
            raise ImageError("not a PNG, JPEG, WebP or GIF image") from None
        raise ImageError(f"a {fmt} image whose header cannot be read: corrupt, or zero-sized") from None
    except Image.DecompressionBombError as e:  # Pillow's own, far higher limit, also checked on the header
        raise ImageError(f"the image is over the limit of {max_pixels:,} decoded pixels ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"unreadable image header: {e}") from None
    check_size(*image.size, max_pixels)
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as e:
        raise ImageError(f"the {image.format} image data is truncated or corrupt: {e}") from None
    return image


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: (height, width) as multiples of `factor` near the original aspect,
    with height·width in [min_pixels, max_pixels] (Python's round: halves go to even)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"the image is {width} × {height} pixels: an aspect ratio over {MAX_ASPECT}:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (the processor's convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _normalised(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(256, channels) float32: each byte value rescaled and normalised per channel, with the
    processor's roundings (x · (1/255) in float64, then float32 (x − mean) / std)."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)[:, None]
    return (scaled - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def image_rows(
    image: Image.Image,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    patch_size: int = 16,
    merge_size: int = 2,
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> PixelRows:
    """The rows of a decoded image, resized so that its token count lies in [min_tokens, max_tokens]
    (as smart_resize bounds it)."""
    pixels = resized_pixels(to_rgb(image), min_tokens, max_tokens, patch_size * merge_size)
    return pixel_rows(pixels, patch_size, merge_size, mean, std)


def resized_pixels(rgb: Image.Image, min_tokens: int, max_tokens: int, factor: int) -> np.ndarray:
    """(height, width, 3) uint8: an RGB image resized (bicubic) to smart_resize's multiples of `factor`."""
    if not 1 <= min_tokens <= max_tokens:
        raise PagelmError(f"image token bounds {min_tokens}..{max_tokens}: expected 1 <= min <= max")
    height, width = smart_resize(rgb.height, rgb.width, factor, min_tokens * factor**2, max_tokens * factor**2)
    return np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC))


def pixel_rows(pixels: np.ndarray, patch_size: int = 16, merge_size: int = 2,
               mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5)) -> PixelRows:
    """The rows of resized pixels (height, width, 3) uint8, both sides multiples of patch · merge."""
    height, width = pixels.shape[:2]
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks = pixels.reshape(grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size,
                            patch_size, CHANNELS)
    # (block_row, block_col, in_row, in_col, channel, y, x)
    patches = blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(grid_h * grid_w, CHANNELS, 1, patch_size**2)
    values = _normalised(mean, std)[patches, np.arange(CHANNELS)[:, None, None]]
    rows = np.broadcast_to(values, (grid_h * grid_w, CHANNELS, TEMPORAL_PATCH, patch_size**2))
    return PixelRows(rows.reshape(grid_h * grid_w, -1), (1, grid_h, grid_w), merge_size)


def preprocess(
    data: bytes,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_decoded_pixels: int = MAX_DECODED_PIXELS,
    patch_size: int = 16,
    merge_size: int = 2,
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> PixelRows:
    """An encoded image (PNG, JPEG, WebP, GIF) into the tower's rows; ImageError names what is wrong."""
    return image_rows(decode_image(data, max_decoded_pixels), min_tokens, max_tokens, patch_size, merge_size,
                      mean, std)
