"""Speculative decoding of one session: where drafts come from (`PromptLookup`, `Prediction`, `DraftModel`), how many to try
(`Speculator`), and the generation loop that checks them in one verify pass and keeps what the
sequence's own choice makes (`speculative_tokens`).

Owns only which tokens to try and which to keep. Every logit comes from `Session.verify`, bit for bit
decode's, and every token from the sequence's `Chooser` at its own position (a seeded draw depends
on (seed, position) alone), so an answer is the same with speculation on or off.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from pagelm.errors import PagelmError
from pagelm.weights.linear import MAX_GEMV_ROWS

if TYPE_CHECKING:
    from pagelm.engine.model import Model
    from pagelm.engine.session import Chooser, Mark, Session

# `--speculate`; auto: lookup (then the file's MTP layer, where it has one) where the measured costs say it
# pays; mtp: the file's own MTP layer
MODES = ("auto", "off", "lookup", "mtp")
NO_MTP = "speculate 'mtp': this model file has no multi-token-prediction layer (GGUF nextn_predict_layers, mtp.*)"
MAX_DRAFTS = MAX_GEMV_ROWS - 1  # a verify pass is the last token chosen and the drafts after it


def _followers(text: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Where in `text` a token follows an occurrence of `tail`: each occurrence's end."""
    n = tail.size
    if text.size <= n:
        return np.empty(0, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)  # each with a token after it
    return np.flatnonzero((windows == tail).all(axis=1)) + n


class PromptLookup:
    """Drafts from the context itself: the n-gram that ends it (at most `longest` tokens, at least
    `shortest`; the longest found wins) found earlier in it, latest first, proposes the tokens
    that followed it there. (A draft source: `draft(context, start, limit)`, `start` where the
    answer begins in the context.)"""

    def __init__(self, longest: int = 3, shortest: int = 2):
        if not 1 <= shortest <= longest:
            raise PagelmError(f"prompt lookup n-grams of {shortest} to {longest} tokens")
        self.longest, self.shortest = longest, shortest

    def follower(self, ctx: np.ndarray) -> int | None:
        """Where in ctx the tokens after its drafting n-gram start (its latest earlier occurrence); None."""
        for n in range(min(self.longest, ctx.size - 1), self.shortest - 1, -1):
            hits = _followers(ctx, ctx[ctx.size - n :])
            if hits.size:
                return int(hits[-1])
        return None

    def draft(self, context: Sequence[int], start: int, limit: int) -> list[int]:
        ctx = np.asarray(context, dtype=np.int64)
        at = self.follower(ctx)
        return [] if at is None else ctx[at : at + limit].tolist()


class Prediction:
    """Drafts from a text the answer is expected to mostly repeat (OpenAI's `prediction`, such as a
    file being edited), as tokens: its start before the answer has any; then what follows, in the
    prediction, the longest n-gram of two or more tokens ending the answer (or its first token) found
    at most `NEAR` tokens past the last place followed (the answer going on with the prediction); else prompt
    lookup over the prediction followed by the context (latest first: in the answer, the prompt,
    then the prediction; a draft from the prediction ends where it ends); else what follows the
    answer's last token in the prediction, nearest after the last place followed (the answer past an
    edit). (Following the prediction's n-grams wherever they were found kept 6.1 tokens a pass where
    prompt lookup kept 9.7, on Gemma 3 270M, which began by repeating its instructions, which the
    prediction lacks: their n-grams were found all over it. NEAR 256 keeps 9.7 there and 3.65 on
    SmolLM2, whose answer rewrites a docstring (`pagelm bench speculate MODEL --tasks edit`); a window
    of 32 kept fewer on SmolLM2, any distance ahead fewer on Gemma 3.)"""

    NEAR = 256

    def __init__(self, tokens: Sequence[int], longest: int = 3):
        self.tokens, self.longest = np.asarray(tokens, dtype=np.int64), longest
        self.lookup = PromptLookup(longest)
        self._at = 0  # where in the prediction the last draft from it came from

    def draft(self, context: Sequence[int], start: int, limit: int) -> list[int]:
        answer = np.asarray(context[start:], dtype=np.int64)
        if answer.size == 0:
            return self.tokens[:limit].tolist()
        for n in range(min(self.longest, answer.size), min(answer.size, 2) - 1, -1):  # one token: the answer's first
            hits = _followers(self.tokens, answer[answer.size - n :])
            near = hits[(hits >= self._at) & (hits <= self._at + self.NEAR)]
            if near.size:
                return self._from(int(near[0]), limit)
        joined = np.concatenate([self.tokens, np.asarray(context, dtype=np.int64)])
        at = self.lookup.follower(joined)
        if at is not None:
            return joined[at : at + limit].tolist() if at >= self.tokens.size else self._from(at, limit)
        hits = _followers(self.tokens, answer[-1:])
        if not hits.size:
            return []
        ahead = hits[hits >= self._at]
        return self._from(int(ahead[0] if ahead.size else hits[-1]), limit)

    def _from(self, at: int, limit: int) -> list[int]:
        self._at = at
        return self.tokens[at : at + limit].tolist()


class DraftModel:
    """Drafts from a smaller model with the same vocabulary: its greedy tokens after the context,
    from its own session, which follows the context from one call to the next. What the drafting
    fed past the context is taken back at the next call (`Session.back_to` the mark taken before
    drafting): for a model whose whole state is indexed by position the kept drafts stay, for one
    with a recurrent state they are fed again with the token chosen after them."""

    def __init__(self, session: Session):
        self.session = session
        self._mark: Mark | None = None

    @classmethod
    def of(cls, model: Model, vocab_size: int, max_len: int) -> DraftModel:
        """A draft source on `model`, for a target whose vocabulary has `vocab_size` tokens (the
        vocabularies' tokens are the caller's to compare)."""
        if model.head.vocab_size != vocab_size:
            raise PagelmError(f"the draft model has {model.head.vocab_size} tokens in its vocabulary, the model "
                              f"{vocab_size}: a draft model must share the model's vocabulary")
        return cls(model.session(max_len))

    def draft(self, context: Sequence[int], start: int, limit: int) -> list[int]:
        s = self.session
        self._take_back(_common_prefix(s.tokens, context))
        limit = min(limit, s.max_len - len(context) + 1)  # the last draft is not fed
        new = context[len(s.tokens):]
        if limit < 1 or not new:
            return []
        logits = s.prefill(new)
        self._mark = s.mark()
        drafts: list[int] = []
        while True:
            drafts.append(int(np.argmax(logits)))
            if len(drafts) == limit:
                return drafts
            logits = s.decode(drafts[-1])

    def _take_back(self, held: int) -> None:
        """The session down to the first `held` of its tokens (those the context still has)."""
        s, mark = self.session, self._mark
        if held == len(s.tokens):
            return
        if mark is None or held < mark.tokens:  # another context (a new conversation): from the start
            s.reset()
        else:
            s.back_to(mark, mark.tokens if mark.fixed else held)


class FirstOf:
    """Drafts from the first of its sources that has any (auto on a file with an MTP layer: prompt
    lookup, whose drafts cost nothing, then the layer)."""

    def __init__(self, *sources):
        self.sources = sources

    def draft(self, context: Sequence[int], start: int, limit: int) -> list[int]:
        for source in self.sources:
            drafts = source.draft(context, start, limit)
            if drafts:
                return drafts
        return []


class MtpDraft:
    """Drafts from the model file's multi-token-prediction layer (Qwen3.5's MTP, models.qwen35.Qwen35Mtp).
    The layer reads the session's final hidden state at each position t with the token at t + 1
    into its own KV cache, then guesses the tokens ahead one by one, each from its own output and
    the guess before. One a session (`of`), so that its cache follows the session from one
    generation to the next: pairs the context no longer has are dropped (a rewind, another
    conversation), the hidden states read are dropped from the session, and where those it needs
    are gone (a restore) its cache starts over at the first one held (its positions shifted, which
    rope's relative positions do not see; only a shorter past to attend to)."""

    MOST = 3  # drafts a call: each costs a layer and an output head, where prompt lookup's cost nothing

    def __init__(self, session: Session):
        mtp = session.model.network.mtp
        if mtp is None:
            raise PagelmError(NO_MTP)
        self.session, self.mtp = session, mtp
        self.state = mtp.new_state(session.max_len + MAX_DRAFTS)
        self.first = 0  # the session's position of the cache's first pair
        self.tokens: list[int] = []  # the token of each pair in the cache: pair i's is at first + i + 1
        self._last: torch.Tensor | None = None  # the layer's output for the last pair read
        session.keep_hidden = True

    @classmethod
    def of(cls, session: Session) -> MtpDraft:
        if session.mtp_draft is None:
            session.mtp_draft = cls(session)
        return session.mtp_draft

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    @torch.inference_mode()
    def draft(self, context: Sequence[int], start: int, limit: int) -> list[int]:
        s, mtp = self.session, self.mtp
        fed = len(s.tokens)  # the context is the session's tokens and the one chosen after them
        held = _common_prefix(self.tokens, context[self.first + 1 : fed + 1])
        hidden_from = fed if s.hidden is None else s.hidden_from
        if self.first + held < hidden_from:
            self.first, held = hidden_from, 0
        if held < len(self.tokens):
            del self.tokens[held:]
            self._last = None
        self.state.pos = len(self.tokens)  # the drafts' pairs of the last call go
        lo = self.first + held
        if lo < fed:
            ids = np.asarray(context[lo + 1 : fed + 1], dtype=np.int64)
            rows = s.hidden[lo - hidden_from : fed - hidden_from]
            self._last = mtp.forward(mtp.inputs(s.model.embed(ids), rows), self.state)[-1:]
            self.tokens += ids.tolist()
            s.drop_hidden(fed)
        drafts: list[int] = []
        last, limit = self._last, min(limit, self.MOST)
        while last is not None and len(drafts) < limit:
            drafts.append(int(np.argmax(s.model.head.logits(last[0].numpy()))))
            if len(drafts) < limit:
                last = mtp.forward(mtp.inputs(s.model.embed(np.asarray(drafts[-1:], dtype=np.int64)), last), self.state)
        return drafts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


@dataclass
class SpeculationStats:
    """Drafted tokens, those the sequence's own choice kept, and the verify passes that checked them."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0


class StepCosts:
    """What a step costs by the rows it feeds, as measured (moving averages): one row's seconds, the
    seconds each further row adds and those each draft cost its source; and the draft count that
    pays at a given acceptance rate."""

    WEIGHT = 0.2  # of each new measurement in the averages

    def __init__(self):
        self.one: float | None = None
        self.per_row: float | None = None
        self.per_draft: float | None = None  # prompt lookup's: tens of microseconds; an MTP layer's: a layer and the head

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.WEIGHT * (new - old)

    def observe(self, rows: int, seconds: float) -> None:
        if rows == 1:
            self.one = self._average(self.one, seconds)
        elif self.one is not None:
            self.per_row = self._average(self.per_row, max(seconds - self.one, 0.0) / (rows - 1))

    def observe_drafts(self, drafts: int, seconds: float) -> None:
        self.per_draft = self._average(self.per_draft, seconds / drafts)

    def drafts_that_pay(self, rate: float, most: int) -> int:
        """The draft count up to `most` whose expected tokens per second (each draft kept with
        probability `rate` while the ones before it were) beat one-row steps' by the most; 0 where
        none does; `most` until both costs are measured."""
        if self.one is None or self.per_row is None:
            return most
        best, best_gain = 0, 1.0
        for k in range(1, most + 1):
            tokens = k + 1 if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)
            gain = tokens * self.one / (self.one + k * (self.per_row + (self.per_draft or 0.0)))
            if gain > best_gain:
                best, best_gain = k, gain
        return best


class Speculator:
    """One generation's drafting: its source, how many tokens to draft next, and its counts. The
    count doubles while every draft is kept (growing by 2 instead, a text repeated whole reached 11.6
    tokens a pass where doubling reaches 14), falls to one past the kept ones when not; after passes
    that kept nothing, drafting pauses for a while (doubling up to `MAX_PAUSE` steps), so that a
    text that does not repeat costs few passes. With `costs` (auto), the count is also held to what
    pays by the measured step costs and the acceptance seen, and where nothing pays drafting pauses
    `MAX_PAUSE` steps before trying one draft again, twice as long after each such probe that kept
    nothing, up to `MAX_IDLE` (an MTP layer's drafts, each a layer and the output head, that are never
    kept: 0.83-0.94x plain with a probe every 9 steps on a random-weight file)."""

    MAX_PAUSE = 8
    MAX_IDLE = 64
    RATE_WEIGHT = 0.3  # of each pass in the moving acceptance rate

    def __init__(self, source=None, most: int = MAX_DRAFTS, first: int = 4, costs: StepCosts | None = None):
        if not 1 <= most <= MAX_DRAFTS:
            raise PagelmError(f"at most 1 to {MAX_DRAFTS} drafts a pass, got {most}")
        self.source = source or PromptLookup()
        self.most, self.next = most, min(first, most)
        self.stats = SpeculationStats()
        self.costs, self.rate = costs, 0.5  # the moving share of drafts kept
        self._misses, self._pause, self._probe, self._idle = 0, 0, False, self.MAX_PAUSE

    @classmethod
    def of(cls, mode: str, draft: DraftModel | None = None, session: Session | None = None) -> Speculator | None:
        """The speculator a `--speculate` mode asks for in `session`; None for off. With a `draft`
        model its drafts, and for mtp the MTP layer's (their count adapts to the acceptance alone:
        no step costs); auto's from prompt lookup, then the MTP layer where the file has one (their
        count held to what the step costs and their own say pays)."""
        check_mode(mode, None if session is None else session.model)
        if mode == "off":
            return None
        if draft is not None:
            return cls(draft)
        if mode == "mtp":
            if session is None:
                raise PagelmError("speculate 'mtp' drafts for a session: none given")
            return cls(MtpDraft.of(session), most=MtpDraft.MOST, first=MtpDraft.MOST)
        if mode == "auto" and session is not None and session.model.network.mtp is not None:
            return cls(FirstOf(PromptLookup(), MtpDraft.of(session)), costs=StepCosts())
        return cls(costs=StepCosts() if mode == "auto" else None)

    def draft(self, context: Sequence[int], start: int, room: int) -> list[int]:
        """Up to `room` tokens to try after `context`, whose answer begins at `start`."""
        if self._pause:
            self._pause -= 1
            return []
        limit = min(self.next, room)
        if self.costs is not None and limit > 0 and not self._probe:
            pays = self.costs.drafts_that_pay(self.rate, self.most)
            if pays == 0:  # pause, then probe with one draft: the rate seen may have changed
                self._pause, self.next, self._probe = self._idle, 1, True
                self._idle = min(2 * self._idle, self.MAX_IDLE)
                return []
            limit = min(limit, pays)
        self._probe = False
        if limit <= 0:
            return []
        began = time.perf_counter()
        drafts = self.source.draft(context, start, limit)
        if self.costs is not None and drafts:
            self.costs.observe_drafts(len(drafts), time.perf_counter() - began)
        return drafts

    def observe(self, rows: int, seconds: float) -> None:
        """A step of this generation fed `rows` rows in `seconds`."""
        if self.costs is not None:
            self.costs.observe(rows, seconds)

    def record(self, drafted: int, accepted: int) -> None:
        s = self.stats
        s.drafted, s.accepted, s.passes = s.drafted + drafted, s.accepted + accepted, s.passes + 1
        self.rate += self.RATE_WEIGHT * (accepted / drafted - self.rate)
        self.next = min(2 * self.next, self.most) if accepted == drafted else accepted + 1
        self._misses = min(self._misses + 1, self.MAX_PAUSE.bit_length()) if accepted == 0 else 0
        if accepted:
            self._idle = self.MAX_PAUSE
        self._pause = min(2 ** self._misses // 2, self.MAX_PAUSE)


def check_mode(mode: str, model: Model | None) -> None:
    """A clear error for a `--speculate` mode that is not one, or that `model` cannot draft with
    (mtp: a file without an MTP layer; without a model, mtp is only checked when drafting)."""
    if mode not in MODES:
        raise PagelmError(f"speculate {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "mtp" and model is not None and model.network.mtp is None:
        raise PagelmError(NO_MTP)


def speculative_tokens(session: Session, chooser: Chooser, logits: np.ndarray, max_tokens: int,
                       cancel: threading.Event | None, speculator: Speculator) -> Iterator[int]:
    """What `Session.generate` yields from `logits` on, token for token, with drafts checked in
    verify passes: a pass feeds the last token chosen and the drafts after it; the chooser picks
    each row's token (at that row's position) while it is the draft the next row fed; the session
    is rewound to the row of the last token chosen. Whenever the caller stops taking tokens, the
    session holds what generate's one-token steps leave it holding."""
    if max_tokens < 1 or (cancel is not None and cancel.is_set()):
        return
    token, done = chooser.choose(logits)
    produced, start = 0, len(session.tokens)
    while True:
        yield token
        produced += 1
        if done:
            return
        if produced == max_tokens:  # as generate's last step, which feeds its last token
            session.decode(token)
            return
        room = min(max_tokens - produced, session.max_len - len(session.tokens)) - 1
        drafts = speculator.draft([*session.tokens, token], start, min(room, MAX_DRAFTS))
        began = time.perf_counter()
        rows = session.verify([token, *drafts]) if drafts else session.decode(token)[None]
        speculator.observe(len(rows), time.perf_counter() - began)
        base, kept, matched = len(session.tokens) - len(rows), 0, 0
        try:
            for r in range(len(rows)):
                kept = r + 1  # the rows decoding one token at a time holds when it chooses from row r
                if cancel is not None and cancel.is_set():
                    return
                token, done = chooser.choose(rows[r], held=base + kept)
                if r == len(drafts) or token != drafts[r] or done:
                    break
                matched += 1
                yield token
                produced += 1
                if produced == max_tokens:
                    kept = r + 2  # generate feeds its last token too: the pass's next row did
                    return
        finally:
            if drafts:
                speculator.record(len(drafts), matched)
                if kept < len(rows):
                    session.rewind(kept)
