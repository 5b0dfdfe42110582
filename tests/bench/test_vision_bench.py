"""`pagelm bench vision` on the tiny chat shape and its tower: a real server, two small images, the
figures its table is made of (tokens, tower passes, caches, the peak read) and the report."""

import io

import numpy as np
from PIL import Image

from pagelm.bench.inputs import tower_path
from pagelm.bench.vision import photo_jpeg, run_vision


def test_photo_jpeg_is_seeded_and_sized():
    first = photo_jpeg(97, 61, seed=3)
    assert first == photo_jpeg(97, 61, seed=3) and first != photo_jpeg(97, 61, seed=4)
    image = Image.open(io.BytesIO(first))
    assert image.format == "JPEG" and image.size == (97, 61)
    assert np.asarray(image).std() > 10  # not a flat picture


def test_bench_vision_measures_each_image_once_through_the_tower(qwen35_chat_gguf, tmp_path):
    tower = tower_path("qwen3.5-tiny-chat", str(tmp_path))
    sizes = (("128×96", 128, 96), ("400×300", 400, 300))
    report = run_vision([("qwen3.5-tiny-chat", qwen35_chat_gguf, tower)], 1, image_cache_mib=8, sizes=sizes)
    (geometry,) = report.geometries
    small, large = geometry.runs["128×96"][0], geometry.runs["400×300"][0]
    assert small["prompt_tokens"] < large["prompt_tokens"]  # 70 image tokens (scaled up to the minimum) vs 108
    for result in (small, large):
        assert result["tower_passes"] == 1  # the repeat and the new question reuse the embedding
        assert result["tower_s"] > 0 and result["again_cached"] > 64
        assert result["caches_added_mib"] > 0 and result["peak_added_mib"] >= 0
    markdown = report.markdown()
    assert "| qwen3.5-tiny-chat | 400×300 |" in markdown and "MiB per megapixel" in markdown
    assert "(repeats: 0 extra)" in markdown
    assert report.chart(str(tmp_path / "vision.png")).endswith("vision.png")
