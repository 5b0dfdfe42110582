"""One conversation over a model: its tokens, state and last logits; prefill, decode, verify and
rewind (several tokens checked at once, then the unkept ones dropped), generate, checkpoint and
restore (`Session`), and a sequence's choice of its next tokens (`Chooser`).

Owns the token bookkeeping of one sequence; the arithmetic is the network's and the kernels'.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

import numpy as np
import torch

from pagelm.engine.sampling import Constraint, Sampler, SamplingParams
from pagelm.engine.speculate import Speculator, speculative_tokens
from pagelm.errors import PagelmError
from pagelm.models.decoder import Trail, finish
from pagelm.runtime import heap
from pagelm.runtime import threads as threads_module
from pagelm.vision.inputs import IMAGE_PAD

if TYPE_CHECKING:
    from pagelm.engine.model import Model
    from pagelm.vision.inputs import ImageInput


@dataclass(frozen=True)
class Checkpoint:
    tokens: tuple[int, ...]
    images: tuple[str, ...]  # keys of the images among the tokens, in order
    position_delta: int
    state: object  # the network's own checkpoint (KV[:pos] + conv + recurrent)
    logits: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.logits is None else self.logits.nbytes)


@dataclass(frozen=True)
class Mark:
    """A point of a session to come back to after feeding it more tokens (`Session.back_to`): its
    token count and copies of the state not indexed by position (none where the whole state is)."""

    tokens: int
    fixed: tuple[torch.Tensor, ...]


class Session:
    """One conversation's state over a model: the tokens fed so far (and the keys of the images
    among them), the last logits, and how far rope positions run ahead of token indices (images
    take fewer positions than tokens)."""

    def __init__(self, model: Model, max_len: int):
        self.model = model
        self.max_len = max_len
        self.state = model.network.new_state(max_len)
        self.tokens: list[int] = []
        self.images: list[str] = []
        self.position_delta = 0
        self.logits: np.ndarray | None = None
        self.trail = Trail()  # the last verify pass's per-row recurrent states, for rewind
        self._pass: np.ndarray | None = None  # that pass's logits; None: no pass to rewind
        # With keep_hidden, the final hidden states of the positions hidden_from on, as they are fed,
        # until a reader drops them (`drop_hidden`): what a multi-token-prediction layer drafts from.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_from = 0
        self.mtp_draft = None  # the drafter on the model's MTP layer following this session (speculate.MtpDraft.of)

    def reset(self) -> None:
        """Forget everything fed so far; the state's buffers are reused, not reallocated."""
        with torch.inference_mode():
            for t in self.state.fixed_tensors():
                t.zero_()
        self.state.pos = 0
        self.tokens = []
        self.images = []
        self.position_delta = 0
        self.logits = None
        self.hidden = None
        self.forget_pass()

    def held_hidden(self, rows: torch.Tensor) -> None:
        """With keep_hidden, keeps the final hidden states of the rows just fed (the last positions)."""
        if not self.keep_hidden:
            return
        first = len(self.tokens) - rows.shape[0]
        if self.hidden is None or self.hidden_from + self.hidden.shape[0] != first:
            self.hidden, self.hidden_from = rows.clone(), first
        else:
            self.hidden = torch.cat((self.hidden, rows))

    def drop_hidden(self, before: int) -> None:
        """Drops the kept hidden states of the positions before `before`."""
        if self.hidden is not None and before > self.hidden_from:
            self.hidden = self.hidden[before - self.hidden_from :].clone()
            self.hidden_from = before

    def check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(self.tokens) + ids.size > self.max_len:
            raise PagelmError(f"context overflow: {len(self.tokens)} tokens held + {ids.size} new "
                              f"> context length {self.max_len}")
        return ids

    def _image_runs(self, ids: np.ndarray, images: Sequence[ImageInput]) -> list[tuple[int, ImageInput]]:
        """(offset, image) of each image's run of pad tokens in `ids`; with images, the runs must be
        theirs (without, a pad token is text, as one the model samples is)."""
        if not images:
            return []
        if self.model.tower is None:
            raise PagelmError("this model has no vision tower: it cannot read images")
        edges = np.flatnonzero(np.diff(np.concatenate(([0], (ids == IMAGE_PAD).astype(np.int8), [0]))))
        runs = list(zip(edges[::2].tolist(), (edges[1::2] - edges[::2]).tolist()))
        if [n for _, n in runs] != [image.tokens for image in images]:
            raise PagelmError(f"image pad tokens in runs of {[n for _, n in runs][:8]} for images of "
                              f"{[image.tokens for image in images][:8]} tokens")
        return [(offset, image) for (offset, _), image in zip(runs, images)]

    def prefill(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> np.ndarray:
        """Feed tokens (a prompt, or the rest of one after restore); returns the last position's
        logits. `images`: those whose pad tokens (each image's full run) are among the tokens, in order."""
        with torch.inference_mode():
            return finish(self._prefill_steps(tokens, images))

    @torch.inference_mode()
    def prefill_layers(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> Generator:
        """`prefill` one layer at a time: yields after each layer, returns prefill's result, bit for
        bit (a server steps other sessions between two layers). Until it has returned, the session
        is half-updated: drop it (reset or restore) if the generator is not run to its end."""
        return (yield from self._prefill_steps(tokens, images))

    def _prefill_steps(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> Generator:
        """prefill_layers' steps, for a caller in inference mode (Decoder.forward_layers says why)."""
        ids = self.check_tokens(tokens)
        if ids.size == 0:
            raise PagelmError("prefill needs at least one token")
        runs = self._image_runs(ids, images)
        threads_module.use()
        x = self.model.embed(ids)
        positions = None
        if runs or self.position_delta:
            for offset, image in runs:
                x[offset : offset + image.tokens] = self.model.image_embedding(image).to(x.dtype)
            first = len(self.tokens) + self.position_delta
            positions, after = self.model.network.image_positions(first, ids.size, [(offset, *image.merged)
                                                                                    for offset, image in runs])
        self.forget_pass()
        hidden = yield from self.model.network.forward_layers(x, self.state, positions)
        self.tokens.extend(ids.tolist())
        self.held_hidden(hidden)
        self.images.extend(image.key for image in images)
        if positions is not None:
            self.position_delta = after - len(self.tokens)
        self.logits = self.model.head.logits(hidden[-1].float().cpu().numpy())
        if ids.size > heap.TRIM_AFTER_TOKENS:
            heap.trim()  # give the prefill's temporaries back to the OS
        return self.logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (normally the one just sampled); returns the next logits."""
        return self.prefill([token])

    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed 1 to MAX_GEMV_ROWS tokens (the last one chosen and drafts after it) in one pass;
        returns the logits (n, vocab) after each, row r bit for bit what `decode(tokens[r])` returns
        after tokens[:r] were decoded one at a time. The session then holds them all, as decoding
        them would leave it; `rewind(rows)` keeps only the first rows, exactly."""
        return verify_passes([self], [tokens])[0]

    def forget_pass(self) -> None:
        """The last verify pass can no longer be rewound (something else is fed)."""
        self._pass = None

    def rewind(self, rows: int) -> None:
        """Keep the first `rows` tokens of the last `verify` pass (1 to its length), dropping the
        rest: the state (KV caches truncated, recurrent states from the pass's own copies), tokens
        and logits exactly as after decoding those tokens alone. Again with fewer rows as long as
        nothing else was fed."""
        if self._pass is None:
            raise PagelmError("rewind: no verify pass to rewind (something else was fed since)")
        self.trail.rewind(self.state, rows)
        del self.tokens[self.state.pos :]  # a token a position, the pass's from the trail's base
        self.logits = self._pass[rows - 1].copy()
        if self.hidden is not None:
            self.hidden = self.hidden[: max(len(self.tokens) - self.hidden_from, 0)]

    def mark(self) -> Mark:
        with torch.inference_mode():
            return Mark(len(self.tokens), tuple(t.clone() for t in self.state.fixed_tensors()))

    def back_to(self, mark: Mark, keep: int | None = None) -> None:
        """The state exactly as at `mark` (taken on this session, only tokens fed since), or with
        `keep` tokens in all where the whole state is indexed by position: KV caches truncated, the
        positions after them written over before any query reads them."""
        keep = mark.tokens if keep is None else keep
        if not mark.tokens <= keep <= len(self.tokens) or (mark.fixed and keep != mark.tokens):
            raise PagelmError(f"back to {keep} tokens from a mark at {mark.tokens} and {len(self.tokens)} "
                              f"tokens held{' (a recurrent state: the mark itself only)' if mark.fixed else ''}")
        self.forget_pass()
        with torch.inference_mode():
            for live, copy in zip(self.state.fixed_tensors(), mark.fixed):
                live.copy_(copy)
        self.state.pos = keep
        del self.tokens[keep:]
        self.logits = None
        self.hidden = None

    @property
    def nbytes(self) -> int:
        """Anonymous bytes this session holds: its state (the resident pages of KV caches reserved
        for max_len, the DeltaNet and conv states), its last logits, the recurrent states a verify
        pass kept for rewinding, and the hidden states and MTP cache of drafting with an MTP layer."""
        return (self.state.nbytes + (0 if self.logits is None else self.logits.nbytes) + self.trail.nbytes
                + (0 if self.hidden is None else self.hidden.nbytes) + (0 if self.mtp_draft is None else self.mtp_draft.nbytes))

    def checkpoint(self) -> Checkpoint:
        logits = None if self.logits is None else self.logits.copy()
        return Checkpoint(tuple(self.tokens), tuple(self.images), self.position_delta, self.state.checkpoint(), logits)

    def restore(self, checkpoint: Checkpoint) -> None:
        self.forget_pass()
        self.state.restore(checkpoint.state)
        self.tokens = list(checkpoint.tokens)
        self.images = list(checkpoint.images)
        self.position_delta = checkpoint.position_delta
        self.logits = None if checkpoint.logits is None else checkpoint.logits.copy()
        self.hidden = None

    def generate(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, constraint: Constraint | None = None,
                 images: Sequence[ImageInput] = (), speculate: str | Speculator = "off") -> Iterator[int]:
        """Prefill `prompt` (may be empty to continue from the current state) with the `images`
        among its tokens, then yield sampled tokens until a stop token, max_tokens, the context
        end, or `cancel` is set (checked before every step). A stop token is yielded, then
        generation ends. `constraint` (a grammar's matcher) forbids the tokens its grammar does
        not allow at each step. `speculate`: "off", "auto", "lookup" or "mtp" (speculate.MODES), or a
        Speculator (whose `stats` count the drafts): drafts checked in verify passes, the same
        tokens and the same session state after them as without."""
        speculator = Speculator.of(speculate, session=self) if isinstance(speculate, str) else speculate
        logits = self.prefill(prompt, images) if len(prompt) else self.logits
        if logits is None:
            raise PagelmError("generate needs a prompt or a prefilled session")
        chooser = Chooser(self, params, constraint)
        try:
            if speculator is not None:
                yield from speculative_tokens(self, chooser, logits, params.max_tokens, cancel, speculator)
                return
            for _ in range(params.max_tokens):
                if cancel is not None and cancel.is_set():
                    return
                token, done = chooser.choose(logits)
                yield token
                if done:
                    return
                logits = self.decode(token)
        finally:
            heap.trim()  # what the decode steps' temporaries left free on the heap


@torch.inference_mode()
def verify_passes(sessions: Sequence[Session], token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """`Session.verify` of each session (distinct, of one model) with its tokens, all in one pass
    (at most MAX_GEMV_ROWS tokens in all): each matrix read once for every row; each session's
    logits and state what its own pass gives, bit for bit."""
    if not sessions or len(sessions) != len(token_lists) or any(s.model is not sessions[0].model for s in sessions):
        raise PagelmError("verify: one token list for each of one or more sessions, all of one model")
    model = sessions[0].model
    ids = [s.check_tokens(t) for s, t in zip(sessions, token_lists)]
    threads_module.use()
    x = model.embed(np.concatenate(ids))
    positions = [None if not s.position_delta else  # after an image: its own rope positions (text steps one by one)
                 model.network.image_positions(len(s.tokens) + s.position_delta, i.size, [])[0]
                 for s, i in zip(sessions, ids)]
    for s in sessions:
        s.forget_pass()
    hidden = model.network.decode_rows(x, [s.state for s in sessions], [s.trail for s in sessions],
                                       [i.size for i in ids], positions)
    logits = model.head.logits(hidden.float().cpu().numpy())
    out, lo = [], 0
    for s, i in zip(sessions, ids):
        s._pass = rows = logits[lo : lo + i.size]
        s.tokens.extend(i.tolist())
        s.held_hidden(hidden[lo : lo + i.size])
        lo += i.size
        s.logits = rows[-1].copy()
        out.append(rows)
    return out


class Chooser:
    """One sequence's choice of its next tokens, as Session.generate makes it: its sampler and seed,
    the counts its penalties see, its stop tokens and its grammar's matcher."""

    def __init__(self, session: Session, params: SamplingParams, constraint: Constraint | None = None):
        self.session, self.params, self.constraint = session, params, constraint
        self.sampler = Sampler(params)
        self.stops = set(params.stop_tokens) | set(session.model.eos_tokens)
        self.seen = Counter(session.tokens)

    def choose(self, logits: np.ndarray, held: int | None = None) -> tuple[int, bool]:
        """(the next token, whether generation ends with it: a stop token or the context's end).
        `held`: the tokens the sequence holds before it (default: the session's; a verify pass's
        row r has its first tokens and r + 1 of the pass's)."""
        held = len(self.session.tokens) if held is None else held
        if self.constraint is not None:
            # a copy: the session's logits stay the model's own (checkpoints keep them)
            logits = self.constraint.mask(logits.copy())
        token = self.sampler.sample(logits, held, self.seen)
        if self.constraint is not None:
            self.constraint.accept(token)
        done = token in self.stops or held >= self.session.max_len
        if not done:
            self.seen[token] += 1
        return token, done
