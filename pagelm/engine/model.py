"""A model opened for generation: its weights loader, config, token embedding, output head, network
and (Qwen3.5) vision tower with its image-embedding cache.

Owns what a session reads from the model; opening one is `pagelm.engine.load`'s work.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from pagelm.engine.batch import decode_batch
from pagelm.engine.session import Session, verify_passes
from pagelm.errors import PagelmError
from pagelm.vision.cache import EmbeddingCache
from pagelm.weights import OutputHead, TokenEmbedding
from pagelm.weights.loader import WeightLoader

if TYPE_CHECKING:
    from pagelm.vision import VisionTower
    from pagelm.vision.inputs import ImageInput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_IMAGE_CACHE_MIB = 256


class Model:
    """A model file opened for generation (`load.load_model` builds one): the mapped embedding and
    head, the network over its weights (dense or mapped), its config and stop tokens, and the
    threads torch and the kernels use. With a vision tower (`mmproj`, its `tower_loader`), image
    embeddings are kept in `image_cache`."""

    def __init__(self, loader: WeightLoader, config, network, embedding: TokenEmbedding, head: OutputHead,
                 threads: int, image_cache: EmbeddingCache, tower: VisionTower | None = None,
                 tower_loader: WeightLoader | None = None, mmproj: str | None = None):
        self.loader, self.file, self.config, self.network = loader, loader.file, config, network
        self.embedding, self.head, self.threads = embedding, head, threads
        self.tower, self.tower_loader, self.mmproj, self.image_cache = tower, tower_loader, mmproj, image_cache
        eos = self.file.metadata.get("tokenizer.ggml.eos_token_id")
        self.eos_tokens: tuple[int, ...] = () if eos is None else (int(eos),)

    def embed(self, ids: np.ndarray) -> torch.Tensor:
        """The token rows of `ids` (n, hidden) in the compute dtype, their pages hinted first."""
        self.embedding.prefetch(ids)
        rows = self.embedding.lookup(ids)
        if self.embedding.rows == "f32":
            return torch.from_numpy(rows)
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)

    def image_embedding(self, image: ImageInput) -> torch.Tensor:
        """The tower's output for `image` (tokens, hidden) float32, from `image_cache` when it holds it."""
        if self.tower is None:
            raise PagelmError("this model has no vision tower: it cannot read images")
        found = self.image_cache.get(image.key)
        if found is None:
            start = time.perf_counter()
            pixels = image.rows()
            found = self.tower.encode(pixels.rows, pixels.grid)
            self.image_cache.put(image.key, found, time.perf_counter() - start)
        return found

    def session(self, max_len: int = 4096) -> Session:
        return Session(self, max_len)

    def decode_batch(self, sessions: Sequence[Session], tokens: Sequence[int]) -> np.ndarray:
        """One decode step of several sessions of this model (`pagelm.engine.batch.decode_batch`):
        logits (n, vocab), row i bit for bit what sessions[i].decode(tokens[i]) would return."""
        if any(s.model is not self for s in sessions):
            raise PagelmError("decode_batch: every session must be of this model")
        return decode_batch(sessions, tokens)

    def verify_batch(self, sessions: Sequence[Session], token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Several sessions' verify passes in one (`pagelm.engine.session.verify_passes`, at most 16
        tokens in all): each session's logits and state bit for bit what its own `verify` gives."""
        return verify_passes(sessions, token_lists)

    @property
    def weights_nbytes(self) -> int:
        """Anonymous bytes the layer weights hold (dense matrices, or the mapped scratch) and small
        tensors, the vision tower's included."""
        return self.loader.nbytes + (0 if self.tower_loader is None else self.tower_loader.nbytes)
