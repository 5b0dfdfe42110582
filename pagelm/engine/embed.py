"""Embeddings: an input's vector from an embedding model (EmbeddingGemma, Qwen3-Embedding), its
token rows read from the map as for generation, its final hidden states pooled, projected and
normalized as its file says (`weights.pooling`).

Each input is computed alone, from a state of its own: its vector is the same bits whatever else
is embedded in the same call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagelm.engine.model import Model
from pagelm.errors import PagelmError
from pagelm.runtime import threads as threads_module
from pagelm.weights.pooling import EmbeddingHead, embedding_head


class NotAnEmbeddingModel(PagelmError):
    """A generative model asked for embeddings."""


class Embedder:
    """Vectors of token inputs from `model`, through its embedding `head`."""

    def __init__(self, model: Model, head: EmbeddingHead):
        self.model, self.head = model, head
        self.dimensions = head.dimensions or model.config.hidden

    @classmethod
    def of(cls, model: Model) -> Embedder:
        head = embedding_head(model.loader)
        if head is None:
            raise NotAnEmbeddingModel(f"{model.loader.name} is not an embedding model (no pooling in the file: "
                                      f"neither a GGUF pooling_type nor sentence-transformers' modules.json)")
        return cls(model, head)

    def embed(self, tokens: Sequence[int], dimensions: int | None = None) -> np.ndarray:
        """One input's vector (float32); `dimensions`: its first N values, normalized again
        (Matryoshka truncation, as sentence-transformers' truncate_dim)."""
        if dimensions is not None and not 1 <= dimensions <= self.dimensions:
            raise PagelmError(f"dimensions must be in [1, {self.dimensions}], got {dimensions}")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise PagelmError("an input to embed needs at least one token")
        if ids.min() < 0 or ids.max() >= self.model.config.vocab:
            raise PagelmError(f"token ids must be in [0, {self.model.config.vocab}), got {int(ids.min())}..{int(ids.max())}")
        threads_module.use()
        vector = self.head(self.model.network.encode(self.model.embed(ids)))
        if dimensions is not None and dimensions < vector.size:
            vector = vector[:dimensions]
            if self.head.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32, copy=False)

    def embed_all(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> np.ndarray:
        """The vectors (n, dimensions) of several inputs, each computed alone."""
        return np.stack([self.embed(tokens, dimensions) for tokens in inputs]) if inputs else \
            np.zeros((0, dimensions or self.dimensions), np.float32)
