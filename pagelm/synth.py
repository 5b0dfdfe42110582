"""Synthetic models with real geometry and random, seeded values, written by pagelm's own GGUF writer.

Owns the shape table and random block generation; for now it writes the embedding tables only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import ENCODABLE, encode
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType

QWEN35_VOCAB = 248_320


@dataclass(frozen=True)
class EmbeddingShape:
    vocab: int
    dim: int
    embedding_type: GGMLType
    output_type: GGMLType | None  # None: the output head is tied to token_embd


SHAPES: dict[str, EmbeddingShape] = {
    "qwen3.5-0.8b": EmbeddingShape(QWEN35_VOCAB, 1024, GGMLType.Q8_0, None),
    "qwen3.5-2b": EmbeddingShape(QWEN35_VOCAB, 2048, GGMLType.Q8_0, None),
    "qwen3.5-4b": EmbeddingShape(QWEN35_VOCAB, 2560, GGMLType.Q8_0, None),
    "qwen3.5-9b": EmbeddingShape(QWEN35_VOCAB, 4096, GGMLType.BF16, GGMLType.Q8_0),
    "tiny": EmbeddingShape(4096, 256, GGMLType.Q8_0, None),
}

# Byte offsets of the fp16 scale fields (d, and m/dmin where present) inside one block. Random
# bytes elsewhere are valid codes; the scales are drawn so that values stay small and finite.
_SCALE_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}
SYNTH_TYPES = frozenset(_SCALE_FIELDS) | {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
_CHUNK_ROWS = 2048


def random_rows(rng: np.random.Generator, n_rows: int, n_values: int, ggml_type: GGMLType) -> np.ndarray:
    """n_rows encoded rows (uint8, n_rows × row bytes) of random values of a plausible scale."""
    if ggml_type in _SCALE_FIELDS:
        per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
        blocks = rng.integers(0, 256, (n_rows * (n_values // per_block), block_bytes), np.uint8)
        for at in _SCALE_FIELDS[ggml_type]:
            scales = rng.uniform(2e-4, 4e-3, blocks.shape[0]).astype(np.float16)
            blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(n_rows, -1)
    if ggml_type in ENCODABLE:
        return encode(rng.standard_normal((n_rows, n_values), np.float32) * np.float32(0.05), ggml_type)
    raise ValueError(f"synthetic tables of type {ggml_type.name} are not supported")


def _table_chunks(seed: int, vocab: int, dim: int, ggml_type: GGMLType) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    for lo in range(0, vocab, _CHUNK_ROWS):
        yield random_rows(rng, min(_CHUNK_ROWS, vocab - lo), dim, ggml_type)


def write_embedding_model(
    path: str,
    shape: EmbeddingShape,
    seed: int = 0,
    name: str = "synthetic",
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write a qwen35-geometry GGUF holding the embedding (and the untied output head, if any)."""
    tensors = [
        TensorToWrite("token_embd.weight", (shape.dim, shape.vocab), shape.embedding_type,
                      _table_chunks(seed, shape.vocab, shape.dim, shape.embedding_type))
    ]
    if shape.output_type is not None:
        tensors.append(
            TensorToWrite("output.weight", (shape.dim, shape.vocab), shape.output_type,
                          _table_chunks(seed + 1, shape.vocab, shape.dim, shape.output_type))
        )
    metadata = {
        "general.architecture": "qwen35",
        "general.name": name,
        "qwen35.embedding_length": Typed(GGUFValueType.UINT32, shape.dim),
        "qwen35.vocab_size": Typed(GGUFValueType.UINT32, shape.vocab),
        "pagelm.synthetic.seed": Typed(GGUFValueType.UINT64, seed),
        "pagelm.synthetic.embedding_only": True,
    }
    write_gguf(path, metadata, tensors, progress=progress)
