"""Decode steps over several sessions at once: each matrix is read once per step for all of them,
and every session gets bit for bit the logits it would get decoding alone.

Owns the batched step and the generation loop over it (each sequence choosing its tokens with its
own `session.Chooser`); the per-sequence arithmetic stays the models' and the kernels'.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagelm.engine.sampling import Constraint, SamplingParams
from pagelm.engine.session import Chooser, Session
from pagelm.errors import PagelmError
from pagelm.quant.matmul import MAX_GEMV_ROWS
from pagelm.runtime import heap
from pagelm.runtime import threads as threads_module

MAX_BATCH = MAX_GEMV_ROWS  # sequences one step decodes


def _check_batch(sessions: Sequence[Session], tokens: Sequence[int]) -> np.ndarray:
    if not 1 <= len(sessions) <= MAX_BATCH:
        raise PagelmError(f"a batch holds 1 to {MAX_BATCH} sessions, got {len(sessions)}")
    if len({id(s) for s in sessions}) != len(sessions):
        raise PagelmError("a session appears twice in the batch")
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise PagelmError("the sessions of a batch must be of one model")
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size != len(sessions):
        raise PagelmError(f"{ids.size} tokens for {len(sessions)} sessions: one token each")
    for s, token in zip(sessions, ids):
        s.check_tokens([token])
    return ids


@torch.inference_mode()
def decode_batch(sessions: Sequence[Session], tokens: Sequence[int]) -> np.ndarray:
    """Feed tokens[i] to sessions[i] (distinct sessions of one model, at any positions) in one step;
    returns the next logits (n, vocab), row i bit for bit what sessions[i].decode(tokens[i]) returns,
    and leaves each session as that call would (its tokens, state, rope offset, last logits)."""
    ids = _check_batch(sessions, tokens)
    model = sessions[0].model
    threads_module.use()
    x = model.embed(ids)
    positions, afters = [], []
    for s in sessions:  # as Session.prefill: a sequence after an image has its own rope positions
        if s.position_delta:
            p, after = model.network.image_positions(len(s.tokens) + s.position_delta, 1, [])
        else:
            p, after = None, None
        positions.append(p)
        afters.append(after)
    hidden = model.network.decode_batch(x, [s.state for s in sessions], positions)
    logits = model.head.logits(hidden.float().cpu().numpy())
    for i, (s, token, row, after) in enumerate(zip(sessions, ids.tolist(), logits, afters)):
        s.forget_pass()
        s.tokens.append(token)
        s.held_hidden(hidden[i : i + 1])
        if after is not None:
            s.position_delta = after - len(s.tokens)
        s.logits = row.copy()
    return logits


@dataclass
class Request:
    """One sequence of a batched generation: its session (prefilled when `prompt` is empty), the
    prompt to prefill, its sampling, and its grammar's matcher (or None)."""

    session: Session
    prompt: Sequence[int] = ()
    params: SamplingParams = SamplingParams()
    constraint: Constraint | None = None


def generate_batch(requests: Sequence[Request], cancel: threading.Event | None = None) -> list[list[int]]:
    """Each request's generated tokens, as `request.session.generate(prompt, params, cancel, constraint)`
    would yield them alone: prompts are prefilled one at a time, then one batched decode step per
    token advances every sequence still generating; a sequence leaves the batch at its stop token,
    its max_tokens or its context's end. `cancel`, when set, ends them all before the next step."""
    if len({id(r.session) for r in requests}) != len(requests):
        raise PagelmError("a session appears twice in the batch")
    choosers, outputs, logits = [], [[] for _ in requests], []
    for r in requests:
        first = r.session.prefill(r.prompt) if len(r.prompt) else r.session.logits
        if first is None:
            raise PagelmError("generate needs a prompt or a prefilled session")
        choosers.append(Chooser(r.session, r.params, r.constraint))
        logits.append(first)
    active = [i for i, r in enumerate(requests) if r.params.max_tokens > 0]
    try:
        while active and not (cancel is not None and cancel.is_set()):
            tokens, stepping = [], []
            for i in active:
                token, done = choosers[i].choose(logits[i])
                outputs[i].append(token)
                if not done:
                    stepping.append(i)
                    tokens.append(token)
            for lo in range(0, len(stepping), MAX_BATCH):
                part = stepping[lo : lo + MAX_BATCH]
                step = decode_batch([requests[i].session for i in part], tokens[lo : lo + MAX_BATCH])
                for i, row in zip(part, step):
                    logits[i] = row
            active = [i for i in stepping if len(outputs[i]) < requests[i].params.max_tokens]
    finally:
        heap.trim()  # what the decode steps' temporaries left free on the heap
    return outputs
