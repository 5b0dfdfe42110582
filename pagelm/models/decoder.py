"""What every decoder stack shares: input checks, inference mode, long prompts cut into segments,
a forward pass that can pause between layers, and a decode step of several sequences. Owns no model
math: each architecture implements `_layers(x, spans, alone)` over the rows of one or more sequences."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from pagelm.errors import PagelmError
from pagelm.models.norms import MAX_ROWS as FEW_NORM_ROWS
from pagelm.weights.linear import MAX_GEMV_ROWS

# Rows an encoder pass has at least (a span of zeros makes up the rest): every product and norm over
# a pass's rows then takes the many-row path (torch's GEMM and norm), whose row i has the same bits
# whatever the other rows are, so that an input's hidden states are the same encoded alone and packed
# with others (tests/engine/test_embed.py). Below it the few-row kernels (GEMV, norms) would round a
# short input alone otherwise than packed; so would torch's float32 GEMM of under 12 rows (measured).
ENCODE_MIN_ROWS = max(MAX_GEMV_ROWS, FEW_NORM_ROWS) + 1


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Span:
    """Rows lo:hi of a step's activations: consecutive tokens of the sequence whose state this is,
    with their multimodal rope positions (3, hi - lo) where the sequence has them (None: the
    state's next positions)."""

    state: object
    lo: int
    hi: int
    positions: torch.Tensor | None = None


def per_sequence(fn, spans: list, extras: list) -> torch.Tensor:
    """fn(span, extra) for each span (one sequence's rows and what it needs of its own), the
    results stacked in row order: the parts of a step that read or write a sequence's state."""
    if len(spans) == 1:
        return fn(spans[0], extras[0])
    return torch.cat([fn(s, e) for s, e in zip(spans, extras)])


def finish(steps: Generator):
    """Run a generator of steps to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def advance(spans: list) -> None:
    """Each span's state now holds its rows' tokens."""
    for s in spans:
        s.state.pos += s.hi - s.lo


class Decoder:
    """Base of the architecture models: needs `config.hidden`, `device`, `segment` and `_layers`.

    `_layers(x, spans, alone)`: a generator that yields after each layer and returns the final hidden
    states of the rows of x, each span's rows one sequence's, advancing each span's state; with
    `alone` (a batch: one row per span), every row's arithmetic is what it would be with its
    sequence alone. Between two layers only the spans' own states are half-updated, so other
    sequences may be stepped meanwhile and the result does not change by a bit."""

    segment: int

    def _check_input(self, x: torch.Tensor) -> None:
        hidden = self.config.hidden
        if x.dim() != 2 or x.shape[1] != hidden:
            raise PagelmError(f"forward: input of shape {tuple(x.shape)}, expected (T, {hidden})")

    def forward(self, x: torch.Tensor, state, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of input embeddings x (T, hidden). `positions` (3, T): the rope
        positions (t, h, w) of multimodal rope, for the architectures that have it; None: the
        state's next T positions."""
        with torch.inference_mode():
            return finish(self.forward_layers(x, state, positions))

    def forward_layers(self, x: torch.Tensor, state, positions: torch.Tensor | None = None) -> Generator:
        """`forward` one layer at a time, for a caller that runs it in torch.inference_mode (as
        Session.prefill_layers does): yields after each layer, returns forward's result. Until it
        has returned, `state` is half-updated and must not be used otherwise. (Not decorated: torch's
        decorator enters and leaves inference mode at every resumption of a generator, and a decode
        step of SmolLM2 passed through two such decorators 31 times.)"""
        self._check_input(x)
        T = x.shape[0]
        if state.pos + T > state.max_len:
            raise PagelmError(f"forward: pos {state.pos} + {T} tokens exceeds the state's max_len {state.max_len}")
        if positions is not None and tuple(positions.shape) != (3, T):
            raise PagelmError(f"forward: positions of shape {tuple(positions.shape)}, expected (3, {T})")
        if T == 0:
            return torch.empty(0, self.config.hidden, dtype=torch.float32, device=self.device)

        def segment(lo: int, hi: int) -> Generator:
            part = None if positions is None else positions[:, lo:hi]
            return self._layers(x[lo:hi], [Span(state, 0, hi - lo, part)], alone=False)

        if T <= self.segment:
            return (yield from segment(0, T))
        out = torch.empty(T, self.config.hidden, dtype=torch.float32, device=self.device)
        for lo in range(0, T, self.segment):
            out[lo : lo + self.segment] = yield from segment(lo, min(lo + self.segment, T))
        return out

    __call__ = forward

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states of one whole input (T, hidden): `encode_all` of it alone."""
        return self.encode_all([x])[0]

    def encode_all(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Final hidden states of whole inputs xs[i] (T_i, hidden), an embedding model's pass: their
        rows packed into one matrix, so that each product runs once over every row, while attention,
        rope positions (from 0) and state stay each input's own (a state per input, then dropped).
        Never cut into segments, so that a model whose tokens see later ones (EmbeddingGemma) sees
        each whole input. Input i's result is the same bits whatever else is in the pass, where the
        architecture's transcendental activations run per span (layers.gated_mlp's `spans`)."""
        if not xs:
            return []
        for x in xs:
            self._check_input(x)
            if x.shape[0] == 0:
                raise PagelmError("encode: an input needs at least one row")
        rows = sum(x.shape[0] for x in xs)
        # one row per span would take the decode kernels: where every input has one row, the pad has two
        pad = max(ENCODE_MIN_ROWS - rows, 2 if rows == len(xs) else 0)
        parts = [*xs, torch.zeros(pad, self.config.hidden, dtype=xs[0].dtype, device=xs[0].device)] if pad else xs
        spans, lo = [], 0
        for part in parts:
            spans.append(Span(self.new_state(part.shape[0]), lo, lo + part.shape[0]))
            lo += part.shape[0]
        with torch.inference_mode():
            h = finish(self._layers(torch.cat(parts), spans, alone=False))
        return [h[s.lo : s.hi] for s in spans[: len(xs)]]

    def decode_batch(self, x: torch.Tensor, states: list, positions: list | None = None) -> torch.Tensor:
        """Final hidden states (n, hidden) of one token of each of n sequences: x (n, hidden) holds
        their input embeddings, states[i] (distinct) sequence i's state, positions[i] its rope
        positions (3, 1) or None. Row i is bit for bit `forward(x[i:i+1], states[i], positions[i])`."""
        self._check_input(x)
        if len(states) != x.shape[0] or len({id(s) for s in states}) != len(states):
            raise PagelmError(f"decode_batch: {x.shape[0]} rows for {len(states)} states, which must be distinct")
        positions = positions or [None] * len(states)
        for i, (state, p) in enumerate(zip(states, positions)):
            if state.pos + 1 > state.max_len:
                raise PagelmError(f"decode_batch: sequence {i} at pos {state.pos} is at its state's max_len {state.max_len}")
            if p is not None and tuple(p.shape) != (3, 1):
                raise PagelmError(f"decode_batch: positions of sequence {i} of shape {tuple(p.shape)}, expected (3, 1)")
        with torch.inference_mode():
            return finish(self._layers(x, [Span(s, i, i + 1, p) for i, (s, p) in enumerate(zip(states, positions))],
                                       alone=True))
