"""Runs a loaded model once on two tokens, in a session of its own (an embedding model: one input),
so that the kernels of its prefill and of a decode step are compiled (or loaded from the cache) before
a request needs them."""

from __future__ import annotations

from pagelm.engine.embed import Embedder
from pagelm.weights.pooling import embedding_head


def run_first_step(model) -> None:
    """A two-token prefill and one decode step in a throwaway session, or an embedding model's vector of two
    tokens; nothing of it is kept."""
    head = embedding_head(model.loader)
    if head is not None:
        Embedder(model, head).embed([0, 1])
        return
    session = model.session(max_len=8)
    session.prefill([0, 1])
    session.decode(1)
