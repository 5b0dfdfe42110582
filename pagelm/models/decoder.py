"""What every decoder stack shares: input checks, inference mode, long prompts cut into segments,
a forward pass that can pause between layers, a decode step of several sequences, and a pass of
several consecutive tokens of one sequence computed as one-token steps (speculative decoding's
verification) with the recurrent state each row leaves (`Trail`). Owns no model math: each
architecture implements `_layers(x, spans, alone)` over the rows of one or more sequences."""

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


class Trail:
    """The recurrent state (conv windows, DeltaNet states) a pass of one sequence's rows
    (`Decoder.decode_rows`) leaves after each row but its last, in copies reused from pass to pass
    (at most MAX_GEMV_ROWS - 1 of each tensor): what `rewind` puts back, no token decoded again.
    Position-indexed KV needs none: rewinding moves `pos` back, and the positions after it are
    written over before any query reads them."""

    def __init__(self):
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (row, id) -> (live, copy)
        self.base, self.rows = 0, 0  # the state's pos before the last pass, the pass's rows

    @property
    def nbytes(self) -> int:
        return nbytes(copy for _, copy in self._copies.values())

    def copies(self, row: int, tensors) -> list[torch.Tensor] | None:
        """Where the state after `row` of each of `tensors` (live, advanced in place) is kept, for the
        caller to fill (made as needed); None for the pass's last row, whose state is the live one."""
        if row == self.rows - 1:
            return None
        out = []
        for t in tensors:
            entry = self._copies.get((row, id(t)))
            if entry is None or entry[0] is not t:
                entry = self._copies[(row, id(t))] = (t, torch.empty_like(t))
            out.append(entry[1])
        return out

    def keep(self, row: int, tensors) -> None:
        """The state after `row`: a copy of each of `tensors` (live, advanced in place)."""
        for copy, t in zip(self.copies(row, tensors) or (), tensors):
            copy.copy_(t)

    def rewind(self, state, rows: int) -> None:
        """`state` (the one the last pass advanced) exactly as after the pass's first `rows` rows."""
        if not 1 <= rows <= self.rows:
            raise PagelmError(f"rewind to {rows} rows of a pass of {self.rows}")
        if rows < self.rows:
            with torch.inference_mode():
                for (row, _), (live, copy) in self._copies.items():
                    if row == rows - 1:
                        live.copy_(copy)
        state.pos = self.base + rows
        self.rows = rows


class RowState:
    """Row `row` of a pass of consecutive tokens of one sequence through `_layers`: the sequence's
    state as that row's one-token step sees it, at position state.pos + row; every other attribute
    (caches, recurrent states) is the sequence's own. A model that advances a recurrent state in
    place does it row after row (`waves`) and `keep`s it after each, or in one kernel call that
    fills each row's `kept_copies` itself."""

    def __init__(self, state, row: int, trail: Trail):
        self.state, self.row, self.trail = state, row, trail
        self.pos = state.pos + row

    def __getattr__(self, name: str):
        return getattr(self.state, name)


def waves(spans: list) -> list[list[int]]:
    """The spans' indices in groups that hold at most one row of each sequence, in row order: what
    one call of a kernel that advances each sequence's recurrent state in place may take. A step of
    distinct sequences is one group; a pass of one sequence's rows (RowState) a group per row."""
    groups: dict[int, list[int]] = {}
    for j, s in enumerate(spans):
        groups.setdefault(s.state.row if isinstance(s.state, RowState) else 0, []).append(j)
    return [groups[r] for r in sorted(groups)]


def keep(span: Span, *tensors: torch.Tensor) -> None:
    """After a span's recurrent `tensors` advanced by its row: kept for rewinding where the row is
    one of a pass (RowState); nothing otherwise."""
    if isinstance(span.state, RowState):
        span.state.trail.keep(span.state.row, tensors)


def kept_copies(span: Span, *tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """Where `keep` would copy a span's recurrent `tensors` after its row (Trail.copies), for a kernel that
    fills them itself; None where nothing is kept."""
    return span.state.trail.copies(span.state.row, tensors) if isinstance(span.state, RowState) else None


class Decoder:
    """Base of the architecture models: needs `config.hidden`, `device`, `segment` and `_layers`.

    `_layers(x, spans, alone)`: a generator that yields after each layer and returns the final hidden
    states of the rows of x, each span's rows one sequence's, advancing each span's state; with
    `alone` (a batch: one row per span), every row's arithmetic is what it would be with its
    sequence alone. Between two layers only the spans' own states are half-updated, so other
    sequences may be stepped meanwhile and the result does not change by a bit."""

    segment: int
    mtp = None  # a multi-token-prediction layer where the file has one (Qwen3.5's: models.qwen35.Qwen35Mtp)

    def kernel_jobs(self) -> list:
        """Worker jobs (quant.precompile.Job) compiling this network's own one-token kernels where they do not
        depend on the block types' kernels, so that they compile at load beside those: none by default."""
        return []

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

    def decode_rows(self, x: torch.Tensor, states: list, trails: list[Trail], counts: list[int],
                    positions: list | None = None) -> torch.Tensor:
        """Final hidden states of consecutive tokens of each of several sequences in one pass
        (speculative decoding's verification): x holds counts[i] rows of sequence i (state states[i],
        all distinct) after those of the sequences before it, and each row is bit for bit what
        `forward` of that one token gives after the rows before it in its sequence were fed one at a
        time. The products read each matrix once for all rows (each row as alone, as decode_batch's);
        attention and every recurrent state step row by row as one-token decode steps them, over
        each sequence's own caches. Each state ends after its rows; trails[i] keeps what each of
        them left, for `trail.rewind(state, rows)`. positions[i]: sequence i's multimodal rope
        positions (3, counts[i]), or None."""
        self._check_input(x)
        positions = positions or [None] * len(states)
        if not (len(states) == len(trails) == len(counts) == len(positions) and all(n >= 1 for n in counts)
                and sum(counts) == x.shape[0] <= MAX_GEMV_ROWS and len({id(s) for s in states}) == len(states)):
            raise PagelmError(f"decode_rows: {x.shape[0]} rows as {counts} of {len(states)} states (distinct, each at "
                              f"least one row, at most {MAX_GEMV_ROWS} in all)")
        spans = []
        for i, (state, trail, n, p) in enumerate(zip(states, trails, counts, positions)):
            if state.pos + n > state.max_len:
                raise PagelmError(f"decode_rows: sequence {i} at pos {state.pos} + {n} tokens exceeds its state's "
                                  f"max_len {state.max_len}")
            if p is not None and tuple(p.shape) != (3, n):
                raise PagelmError(f"decode_rows: positions of sequence {i} of shape {tuple(p.shape)}, expected (3, {n})")
            lo = len(spans)
            spans += [Span(RowState(state, r, trail), lo + r, lo + r + 1, None if p is None else p[:, r : r + 1])
                      for r in range(n)]
        for state, trail, n in zip(states, trails, counts):
            trail.base, trail.rows = state.pos, n
        with torch.inference_mode():
            hidden = finish(self._layers(x, spans, alone=True))
        for state, trail in zip(states, trails):
            state.pos = trail.base + trail.rows
        return hidden
