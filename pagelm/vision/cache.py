"""The image-embedding cache: the tower's output per image key (`inputs.ImageInput.key`), so the
same image again costs no tower pass.

Bounded in bytes, least recently used dropped first; an embedding larger than the bound is not
kept. The engine thread fills it while request handlers read its counters, hence the lock; it
also counts the tower passes its misses cost and their seconds (what a hit saves).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EmbeddingCache:
    """Image key → (tokens, out_hidden) float32 embedding, LRU within `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recent first
        self.bytes_held = 0
        self.lookups = self.hits = self.evictions = self.tower_passes = 0
        self.tower_seconds = 0.0
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            self.lookups += 1
            found = self._entries.get(key)
            if found is not None:
                self.hits += 1
                self._entries.move_to_end(key)
            return found

    def put(self, key: str, embedding: torch.Tensor, tower_seconds: float = 0.0) -> None:
        """Keep the tower's output for `key` (a pass that took `tower_seconds`)."""
        size = embedding.numel() * embedding.element_size()
        with self._lock:
            self.tower_passes += 1
            self.tower_seconds += tower_seconds
            if size > self.max_bytes:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes_held -= old.numel() * old.element_size()
            self._entries[key] = embedding
            self.bytes_held += size
            while self.bytes_held > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes_held -= dropped.numel() * dropped.element_size()
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"max_bytes": self.max_bytes, "entries": len(self._entries), "bytes_held": self.bytes_held,
                    "lookups": self.lookups, "hits": self.hits, "evictions": self.evictions,
                    "tower_passes": self.tower_passes, "tower_seconds": round(self.tower_seconds, 6)}
