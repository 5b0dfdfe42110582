"""Runs a loaded model once on two tokens, in a session of its own, so that the kernels of its
prefill and of a decode step are compiled (or loaded from the cache) before a request needs them."""

from __future__ import annotations


def run_first_step(model) -> None:
    """A two-token prefill and one decode step in a throwaway session; nothing of it is kept."""
    session = model.session(max_len=8)
    session.prefill([0, 1])
    session.decode(1)
