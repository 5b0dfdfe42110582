"""What the verify-pass tests of every architecture check (tests/engine/test_speculate.py,
tests/models/test_lfm2.py): each row of a pass against one-token decodes, and rewinds."""

import numpy as np
import torch

PROMPT = [11, 400, 7, 3000, 12, 5, 9, 33]
PASSES = [[2, 1000, 17, 250, 8], [44, 61], [90, 3, 77, 300, 301, 302, 4]]  # tokens fed by each verify pass


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def same_state(a, b) -> bool:
    """The sessions hold the same tokens, logits, and recurrent state (the KV caches' positions are
    checked by what decoding after them gives)."""
    return (a.tokens == b.tokens and a.state.pos == b.state.pos and same_bits(a.logits, b.logits)
            and all(torch.equal(x, y) for x, y in zip(a.state.fixed_tensors(), b.state.fixed_tensors())))


def verify_and_rewind(model, position_delta: int = 0) -> None:
    """Each pass's rows against decoding alone; then rewinds to fewer rows against a session that
    decoded only those, and decoding and verifying on from there. (Token ids modulo the vocabulary.)"""
    vocab = model.head.vocab_size
    spec, alone = model.session(max_len=64), model.session(max_len=64)
    for s in (spec, alone):
        s.prefill([t % vocab for t in PROMPT])
        s.position_delta = position_delta  # as after an image: rope positions behind the token count
    for tokens, keep in zip(([t % vocab for t in p] for p in PASSES), (3, 2, 1)):
        rows = spec.verify(tokens)
        assert rows.shape == (len(tokens), model.head.vocab_size)
        reference = model.session(max_len=64)
        reference.restore(alone.checkpoint())
        for r, token in enumerate(tokens):
            assert same_bits(rows[r], reference.decode(token)), f"row {r} of {tokens}"
        assert same_state(spec, reference)
        for token in tokens[:keep]:
            alone.decode(token)
        for kept in range(len(tokens), keep - 1, -1):  # all of them (nothing changes), then fewer and fewer
            spec.rewind(kept)
        assert same_state(spec, alone), f"after keeping {keep} of {tokens}"
    assert same_bits(spec.decode(9), alone.decode(9))


def verify_together(model) -> None:
    """Three sessions' verify passes in one against each one's own, then rewinds and decoding on."""
    vocab = model.head.vocab_size
    prompts = [[t % vocab for t in p] for p in (PROMPT, PROMPT[3:], PROMPT[::-1] + PROMPT)]
    passes = [[t % vocab for t in p] for p in (PASSES[0][:3], PASSES[1][:1], PASSES[2][:5])]
    together, apart = ([model.session(max_len=64) for _ in prompts] for _ in range(2))
    for a, b, prompt in zip(together, apart, prompts):
        a.prefill(prompt)
        b.prefill(prompt)
    rows = model.verify_batch(together, passes)
    for a, b, got, tokens in zip(together, apart, rows, passes):
        assert same_bits(got, b.verify(tokens))
        assert same_state(a, b)
    for a, b, keep in zip(together, apart, (2, 1, 4)):
        a.rewind(keep)
        b.rewind(keep)
        assert same_state(a, b)
        assert same_bits(a.decode(5), b.decode(5))
