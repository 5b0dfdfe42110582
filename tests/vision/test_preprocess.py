"""Pixel rows against transformers' Qwen2-VL image processor (PIL backend, Qwen3.5's settings) for
images of awkward sizes, modes and formats, bit for bit; smart_resize against transformers'; and
images that must be refused, each with an ImageError naming the problem."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from pagelm.errors import ImageError, PagelmError
from pagelm.vision.preprocess import decode_image, preprocess, smart_resize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize  # noqa: E402
from vision_hf import hf_processor  # noqa: E402


def _picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Gradients plus noise: every resampling tap and rounding shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), np.uint8), "L")
        image.putalpha(alpha)
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _gif(width: int, height: int) -> bytes:
    """An animated GIF whose palette has a transparent index: only frame 0 may be used."""
    frames = [_picture(width, height, seed=s).convert("P", palette=Image.Palette.ADAPTIVE) for s in (1, 2)]
    return _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=3, duration=50)


def _rotated_jpeg(width: int, height: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    return _encoded(_picture(width, height, "L"), "JPEG", quality=90, exif=exif.tobytes())


# (label, encoded image, min tokens, max tokens, expected tokens or None)
IMAGES = [
    ("1080 high x 720 wide PNG", lambda: _encoded(_picture(720, 1080), "PNG"), 64, 1024, 748),
    ("720 high x 1080 wide JPEG", lambda: _encoded(_picture(1080, 720), "JPEG", quality=85), 64, 1024, 748),
    ("tiny 6 x 6 PNG", lambda: _encoded(_picture(6, 6), "PNG"), 64, 1024, 64),
    ("tiny 7 x 5 PNG", lambda: _encoded(_picture(7, 5), "PNG"), 64, 1024, 70),
    ("tall 1 x 150 PNG", lambda: _encoded(_picture(1, 150), "PNG"), 64, 1024, None),
    ("wide 400 x 2 PNG (aspect 200)", lambda: _encoded(_picture(400, 2), "PNG"), 64, 1024, None),
    ("odd 333 x 517 RGBA WebP", lambda: _encoded(_picture(333, 517, "RGBA"), "WEBP", quality=80), 64, 1024, None),
    ("animated 97 x 61 GIF with transparency", lambda: _gif(97, 61), 64, 1024, None),
    ("grey 641 x 479 JPEG rotated by EXIF", lambda: _rotated_jpeg(641, 479), 64, 1024, None),
    ("1920 x 1080 PNG over the token cap", lambda: _encoded(_picture(1920, 1080), "PNG"), 64, 1024, None),
    ("640 x 480 PNG, custom bounds", lambda: _encoded(_picture(640, 480, "P"), "PNG"), 16, 100, None),
    ("lossless WebP 257 x 255", lambda: _encoded(_picture(257, 255), "WEBP", lossless=True), 64, 1024, None),
]


@pytest.mark.parametrize("label, make, min_tokens, max_tokens, tokens", IMAGES, ids=[i[0] for i in IMAGES])
def test_rows_identical_to_transformers(label, make, min_tokens, max_tokens, tokens):
    data = make()
    ours = preprocess(data, min_tokens=min_tokens, max_tokens=max_tokens)
    # transformers' load_image applies the EXIF orientation before the processor sees the image
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    ref = hf_processor(min_tokens, max_tokens)(images=[reference], return_tensors="np")
    assert ours.grid == tuple(ref["image_grid_thw"][0])
    assert ours.rows.dtype == np.float32 and ours.rows.shape == ref["pixel_values"].shape
    assert np.array_equal(ours.rows, ref["pixel_values"])
    assert min_tokens <= ours.tokens <= max_tokens or label.startswith("tall")
    if tokens is not None:
        assert ours.tokens == tokens


def test_rotated_jpeg_is_upright():
    rows = preprocess(_rotated_jpeg(641, 479))
    assert rows.grid[1] > rows.grid[2]  # stored landscape, shown portrait


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(0)
    sizes = [(1080, 720), (720, 1080), (1920, 1080), (16, 48), (1, 150), (48, 16), (3200, 16)]
    sizes += [tuple(int(v) for v in rng.integers(1, 4000, 2)) for _ in range(3000)]
    sizes += [(32 * k + 16, 32 * j + 16) for k in range(0, 40, 3) for j in range(0, 40, 7)]  # halves: to even
    for height, width in sizes:
        if max(height, width) / min(height, width) > 200:
            continue
        for low, high in ((64, 1024), (4, 16), (256, 256), (64, 16384)):
            expected = hf_smart_resize(height, width, 32, low * 1024, high * 1024)
            assert smart_resize(height, width, 32, low * 1024, high * 1024) == expected, (height, width, low, high)


def _png_with_size(width: int, height: int) -> bytes:
    """A valid 2 x 2 PNG whose header claims another size (CRC fixed)."""
    data = bytearray(_encoded(_picture(2, 2), "PNG"))
    ihdr = 8 + 8  # signature, chunk length + type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13])))
    return bytes(data)


def test_decompression_bomb_refused_before_decoding():
    # the header says 100,000 × 100,000; the data holds 2 × 2 pixels, so a decoder would have
    # failed with "truncated": the size check came first
    for width, height in ((8000, 8000), (100_000, 100_000)):
        with pytest.raises(ImageError, match="over the limit of 50,000,000 decoded pixels"):
            decode_image(_png_with_size(width, height))
    with pytest.raises(ImageError, match="over the limit of 1,000 decoded pixels"):
        preprocess(_encoded(_picture(50, 40), "PNG"), max_decoded_pixels=1000)


@pytest.mark.parametrize("label, data, message", [
    ("truncated PNG", lambda: _encoded(_picture(300, 200), "PNG")[:2000], "truncated or corrupt"),
    ("truncated JPEG", lambda: _encoded(_picture(300, 200), "JPEG")[:1500], "truncated or corrupt"),
    ("random bytes", lambda: bytes(np.random.default_rng(1).integers(0, 256, 5000, np.uint8)), "not a PNG"),
    ("empty", lambda: b"", "not a PNG"),
    ("BMP", lambda: _encoded(_picture(8, 8), "BMP"), "not a PNG"),
    ("zero width", lambda: _png_with_size(0, 2), "a PNG image whose header cannot be read"),
    ("zero height", lambda: _png_with_size(2, 0), "a PNG image whose header cannot be read"),
    ("JPEG signature, then garbage", lambda: b"\xff\xd8\xff" + bytes(100), "JPEG image whose header"),
    ("aspect 201:1", lambda: _encoded(_picture(1, 201), "PNG"), "aspect ratio over 200:1"),
    ("aspect 1:250", lambda: _encoded(_picture(250, 1), "GIF"), "aspect ratio over 200:1"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_images_raise_image_error(label, data, message):
    with pytest.raises(ImageError, match=message):
        preprocess(data())


def test_token_bounds_checked():
    with pytest.raises(PagelmError, match="token bounds"):
        preprocess(_encoded(_picture(64, 64), "PNG"), min_tokens=100, max_tokens=10)
