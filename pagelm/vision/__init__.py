"""Image input for Qwen3.5: its vision tower read from llama.cpp's mmproj GGUF (`mmproj`), images
made into pixel rows as transformers does (`preprocess`), the tower's math (`tower`), images as
prompts carry them (`inputs`) and the cache of their embeddings (`cache`)."""

from pagelm.errors import ImageError
from pagelm.vision.mmproj import SHAPES, VisionConfig, load_weights, plan_mmproj, write_mmproj
from pagelm.vision.preprocess import PixelRows, decode_image, image_rows, preprocess, smart_resize
from pagelm.vision.tower import VisionTower

__all__ = [
    "ImageError", "PixelRows", "SHAPES", "VisionConfig", "VisionTower", "decode_image", "image_rows",
    "load_weights", "plan_mmproj", "preprocess", "smart_resize", "write_mmproj",
]
