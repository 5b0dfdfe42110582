"""Prompt-prefix checkpoints for a server's one engine session, hybrid models included.

A DeltaNet state cannot be cut back to an earlier position, so the cache keeps whole
checkpoints: the recurrent + conv state at a token position and the attention K/V before it.
K/V is held in segments: a checkpoint taken after another one in the same request shares that
one's segments and adds only the positions between them, so a shared prefix is stored once.
A segment lives as long as any checkpoint refers to it. Eviction is least-recently-used within
a slot count and a byte bound. A checkpoint is keyed by its tokens and by the keys of the images
among them: a different image of the same size at the same place has the same tokens but is never
a hit. The engine thread changes the cache while request handlers read its counters, hence the lock.

A checkpoint taken at the end of a whole prompt also keeps its logits, and serves only that same
prompt again (nothing left to prefill): it sits where no other request cuts its prefill, so as a
prefix of a longer prompt it would change that prompt's arithmetic.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagelm.engine.session import Session
from pagelm.models.decoder import nbytes


@dataclass(frozen=True, eq=False)
class KVSegment:
    """K/V of every attention layer for positions [start, end)."""

    start: int
    end: int
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def nbytes(self) -> int:
        return nbytes(t for pair in self.layers for t in pair)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The session state after `tokens` (with `images` among them): K/V segments covering
    [0, len(tokens)), the fixed state, and the session's rope position offset."""

    tokens: tuple[int, ...]
    images: tuple[str, ...]
    position_delta: int
    segments: tuple[KVSegment, ...]
    fixed: tuple[torch.Tensor, ...]
    logits: np.ndarray | None = None  # kept at the end of a whole prompt only

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        return self.tokens, self.images

    @property
    def fixed_nbytes(self) -> int:
        return nbytes(self.fixed) + (0 if self.logits is None else self.logits.nbytes)

    def starts(self, tokens: Sequence[int], images: Sequence[str]) -> bool:
        """Whether these are the first tokens of `tokens` and the first images of `images`."""
        return (tuple(tokens[: len(self.tokens)]) == self.tokens
                and tuple(images[: len(self.images)]) == self.images)


class PrefixCache:
    """Longest-prefix lookup over checkpoints of one session's state, LRU within `slots` and `max_bytes`."""

    def __init__(self, slots: int, max_bytes: int):
        self.slots, self.max_bytes = slots, max_bytes
        self._entries: OrderedDict[tuple, Checkpoint] = OrderedDict()  # by Checkpoint.key, least recent first
        self.lookups = self.hits = self.tokens_reused = self.evictions = 0
        self._lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        return self.slots > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            entries = list(self._entries.values())
        segments = {id(s): s for c in entries for s in c.segments}
        return sum(s.nbytes for s in segments.values()) + sum(c.fixed_nbytes for c in entries)

    def lookup(self, prompt: Sequence[int], images: Sequence[str] = ()) -> Checkpoint | None:
        """The checkpoint of this whole prompt with its logits, else the longest one whose tokens
        are a proper prefix of `prompt` (at least one token must remain to produce logits); its
        images the first of `images` (the keys of the prompt's images). Marked most recently
        used; None on a miss."""
        if not self.enabled:
            return None
        with self._lock:
            self.lookups += 1
            best = self._longest(prompt, images, len(prompt) - 1, whole=True)
            if best is not None:
                self.hits += 1
                self.tokens_reused += len(best.tokens)
        return best

    def longest(self, tokens: Sequence[int], images: Sequence[str] = ()) -> Checkpoint | None:
        """The longest checkpoint whose tokens are a prefix of `tokens` or all of them (and its
        images the first of `images`), marked most recently used; not counted as a lookup (the
        server's own use, not a request's)."""
        if not self.enabled:
            return None
        with self._lock:
            return self._longest(tokens, images, len(tokens))

    def _longest(self, tokens: Sequence[int], images: Sequence[str], limit: int,
                 whole: bool = False) -> Checkpoint | None:
        """The longest prefix checkpoint of at most `limit` tokens; with `whole`, a whole-prompt
        checkpoint of exactly these tokens first."""
        best = self._entries.get((tuple(tokens), tuple(images))) if whole else None
        if best is not None and best.logits is not None:
            self._entries.move_to_end(best.key)
            return best
        best = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            if entry.logits is None and n <= limit and (best is None or n > len(best.tokens)) \
                    and entry.starts(tokens, images):
                best = entry
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def restore(self, entry: Checkpoint, session: Session) -> None:
        """Put `session` exactly in the state `entry` was taken from."""
        state = session.state
        with torch.inference_mode():
            for segment in entry.segments:
                for (k, v), (sk, sv) in zip(state.kv_pairs(), segment.layers):
                    k[:, segment.start : segment.end].copy_(sk)
                    v[:, segment.start : segment.end].copy_(sv)
            for dst, src in zip(state.fixed_tensors(), entry.fixed):
                dst.copy_(src)
        state.pos = len(entry.tokens)
        session.tokens = list(entry.tokens)
        session.images = list(entry.images)
        session.position_delta = entry.position_delta
        session.logits = None if entry.logits is None else entry.logits.copy()

    def store(self, session: Session, base: Checkpoint | None = None, whole: bool = False) -> Checkpoint | None:
        """Checkpoint the session's current state; `whole` when it is the end of a whole prompt
        (its logits are kept too). `base` must be a checkpoint the session's state descends from
        (restored from it or stored earlier in this request): its K/V segments are shared and
        only the positions after it are copied. Returns the checkpoint (an existing one for the
        same tokens is just touched, unless it is a whole-prompt one and this is not), or None when
        the cache is off or the checkpoint alone exceeds the byte bound."""
        if not self.enabled or not session.tokens:
            return None
        tokens, images = tuple(session.tokens), tuple(session.images)
        key = (tokens, images)
        with self._lock:
            # a prefix checkpoint of the same tokens serves more requests than a whole-prompt one
            if key in self._entries and (self._entries[key].logits is None or whole):
                self._entries.move_to_end(key)
                return self._entries[key]
        start = 0
        if base is not None and base.starts(tokens, images):
            start = len(base.tokens)
        else:
            base = None
        state = session.state
        with torch.inference_mode():
            segments = () if base is None else base.segments
            if start < len(tokens):
                layers = tuple((k[:, start : len(tokens)].clone(), v[:, start : len(tokens)].clone())
                               for k, v in state.kv_pairs())
                segments += (KVSegment(start, len(tokens), layers),)
            fixed = tuple(t.clone() for t in state.fixed_tensors())
        logits = session.logits.copy() if whole else None
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = Checkpoint(tokens, images, session.position_delta, segments, fixed, logits)
            while self._entries and (len(self._entries) > self.slots or self.bytes_held > self.max_bytes):
                self._entries.popitem(last=False)
                self.evictions += 1
            return self._entries.get(key)

    def stats(self) -> dict:
        with self._lock:
            return {"enabled": self.enabled, "slots": self.slots, "max_bytes": self.max_bytes,
                    "entries": len(self._entries), "bytes_held": self.bytes_held, "lookups": self.lookups,
                    "hits": self.hits, "tokens_reused": self.tokens_reused, "evictions": self.evictions}
