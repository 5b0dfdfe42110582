"""Image input for Qwen3.5: its vision tower read from llama.cpp's mmproj GGUF (`mmproj`), images
made into pixel rows as transformers does (`preprocess`), the tower's math (`tower`), images as
prompts carry them (`inputs`) and the cache of their embeddings (`cache`). Random towers are
`pagelm.tools.synth_tower`'s."""

from pagelm.errors import ImageError
from pagelm.vision.mmproj import VisionConfig, load_weights
from pagelm.vision.preprocess import PixelRows, decode_image, image_rows, preprocess, smart_resize
from pagelm.vision.tower import VisionTower

__all__ = [
    "ImageError", "PixelRows", "VisionConfig", "VisionTower", "decode_image", "image_rows", "load_weights",
    "preprocess", "smart_resize",
]
