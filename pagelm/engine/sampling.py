"""Choosing the next token from logits: penalties, temperature, top-k, top-p, min-p, seeded draws,
and what a constraint (a grammar's matcher) must offer to forbid tokens (`Constraint`).

Owns only the arithmetic on one logits vector; it never sees the model or its state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pagelm.errors import PagelmError

# top-p without top-k first looks among this many best tokens; it sorts the whole vocabulary only
# when their probabilities do not reach top_p.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy (argmax after penalties)
    top_k: int = 0  # 0 → off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style: divide positive logits of seen tokens, multiply negative
    presence_penalty: float = 0.0  # OpenAI style: minus this once for every token seen
    frequency_penalty: float = 0.0  # minus this times the token's count
    seed: int | None = None
    max_tokens: int = 256
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    # tokens of reasoning before an open think block is closed for the answer (pagelm.chat.budget); None: no bound
    reasoning_budget: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.reasoning_budget is None or self.reasoning_budget >= 0, "reasoning_budget must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise PagelmError(f"bad sampling parameter: {message}")


class Constraint(Protocol):
    """One generation's place in a grammar (`pagelm.chat.grammar.Matcher` is one): `mask` sets the
    logits of the tokens it forbids to -inf (in place, returning them), `accept` takes the token chosen."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...


class Sampler:
    """Draws tokens for one generation. The draw for the token at position p of a sequence is a
    function of (seed, p) alone: the same seed repeats the same choices, and a token comes out the
    same whether the ones before it were decoded one at a time or several were checked at once (as
    speculative decoding checks drafts). Without a seed, one is drawn for the generation."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.seed = seed % 2**64  # any integer a request gives, as numpy's seeds must be non-negative

    def uniform(self, position: int) -> float:
        """The draw in [0, 1) for the token at `position`."""
        return float(np.random.default_rng((self.seed, position)).random())

    def penalize(self, logits: np.ndarray, seen: Counter) -> np.ndarray:
        p = self.params
        if not seen or (p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0):
            return logits
        logits = logits.copy()
        ids = np.fromiter(seen.keys(), np.int64, len(seen))
        counts = np.fromiter(seen.values(), np.float32, len(seen))
        values = logits[ids]
        if p.repetition_penalty != 1:
            values = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        values = values - p.presence_penalty - p.frequency_penalty * counts
        logits[ids] = values
        return logits

    def sample(self, logits: np.ndarray, position: int, seen: Counter | None = None) -> int:
        """The token at `position` of its sequence, from the logits that predict it."""
        p = self.params
        logits = self.penalize(logits, seen or Counter())
        if p.temperature == 0 or p.top_k == 1:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        allowed = np.isfinite(scaled)
        if allowed.all():
            ids, scaled = self._candidates(scaled)
        else:  # a grammar forbade some tokens (-inf): draw among the others
            index = np.flatnonzero(allowed)
            ids, scaled = self._candidates(scaled[index])
            ids = index[ids]
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.min_p > 0:
            keep = probs >= p.min_p * probs.max()
            ids, probs = ids[keep], probs[keep] / probs[keep].sum()
        cdf = np.cumsum(probs)
        return int(ids[min(int(np.searchsorted(cdf, self.uniform(position) * cdf[-1], side="right")), ids.size - 1)])

    def _candidates(self, scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and their scaled logits after top-k and top-p (best first when either cuts)."""
        p = self.params
        limit = p.top_k or (_TOP_P_CANDIDATES if p.top_p < 1 else 0)
        if not limit:
            return np.arange(scaled.size), scaled  # every token stays a candidate: no order needed
        if limit < scaled.size:
            ids = np.argpartition(-scaled, limit - 1)[:limit]
        else:
            ids = np.arange(scaled.size)
        ids = ids[np.argsort(-scaled[ids], kind="stable")]
        if p.top_p < 1:
            base = scaled[ids[0]]
            # top-p applies to what top-k left; without top-k, to the whole vocabulary
            total = np.exp(scaled[ids] - base).sum() if p.top_k else np.exp(scaled - base).sum()
            cumulative = np.cumsum(np.exp(scaled[ids] - base)) / total
            if cumulative[-1] < p.top_p and not p.top_k and ids.size < scaled.size:
                ids = np.argsort(-scaled, kind="stable")  # the candidates fell short: sort them all
                cumulative = np.cumsum(np.exp(scaled[ids] - base)) / total
            ids = ids[: int(np.searchsorted(cumulative, p.top_p)) + 1]
        return ids, scaled[ids]
