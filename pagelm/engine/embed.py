"""Embeddings: an input's vector from an embedding model (EmbeddingGemma, Qwen3-Embedding), its
token rows read from the map as for generation, its final hidden states pooled, projected and
normalized as its file says (`weights.pooling`).

Many inputs are computed together: packed into passes of at most PASS_TOKENS tokens, each pass one
`Decoder.encode_all` (every product once over all its rows, attention within each input), so that
an input's vector is the same bits alone and among others; a longer input has a pass of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagelm.engine.model import Model
from pagelm.errors import PagelmError
from pagelm.runtime import threads as threads_module
from pagelm.weights.pooling import EmbeddingHead, embedding_head

PASS_TOKENS = 4096  # bounds a pass's activations (and its inputs' states), not the inputs' count


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
        return self.embed_all([tokens], dimensions)[0]

    def embed_all(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> np.ndarray:
        """The vectors (n, dimensions) of several inputs, computed together in passes of at most
        PASS_TOKENS tokens; each row the same bits as `embed` of its input alone."""
        if dimensions is not None and not 1 <= dimensions <= self.dimensions:
            raise PagelmError(f"dimensions must be in [1, {self.dimensions}], got {dimensions}")
        ids = [self._checked(tokens) for tokens in inputs]
        vectors = np.zeros((len(ids), dimensions or self.dimensions), np.float32)
        threads_module.use()
        for batch in _passes([len(i) for i in ids], PASS_TOKENS):
            states = self.model.network.encode_all([self.model.embed(ids[i]) for i in batch])
            for i, hidden in zip(batch, states):
                vectors[i] = self._truncated(self.head(hidden), dimensions)
        return vectors

    def _checked(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise PagelmError("an input to embed needs at least one token")
        if ids.min() < 0 or ids.max() >= self.model.config.vocab:
            raise PagelmError(f"token ids must be in [0, {self.model.config.vocab}), got {int(ids.min())}..{int(ids.max())}")
        return ids

    def _truncated(self, vector: np.ndarray, dimensions: int | None) -> np.ndarray:
        if dimensions is not None and dimensions < vector.size:
            vector = vector[:dimensions]
            if self.head.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector


def _passes(lengths: list[int], budget: int) -> list[list[int]]:
    """The inputs' indices in order, cut into runs of at most `budget` tokens (an input longer than
    that alone in its run)."""
    runs: list[list[int]] = []
    total = budget
    for i, n in enumerate(lengths):
        if total + n > budget:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs
