"""transformers as the oracle of a checkpoint pagelm opens: greedy decoding checked against a
teacher-forced reference forward, and random values where transformers initialises a constant."""

from __future__ import annotations

import numpy as np
import torch

REL_TOL = 1e-4
F32_REL_TOL = 1e-5  # float32 weights computed in float32: only the order of sums differs
STEPS = 32
TIE = 1e-4  # a greedy pick may differ only where the reference's top two are this close
PROMPT = [3, 17, 101, 250, 7, 42, 199, 64, 5, 128]


@torch.no_grad()
def perturb_constant_init(model) -> None:
    """Random values for what transformers initialises to a constant (biases, q/k norm weights), so
    that a model that drops them does not agree by chance."""
    for name, p in model.named_parameters():
        if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
            p.add_(torch.randn(p.shape) * 0.2)


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def greedy(model, ids: list[int], steps: int = STEPS) -> tuple[list[int], list[np.ndarray]]:
    """pagelm's greedy tokens after `ids` (a prefill, then decode steps) and the logits each was picked from."""
    session = model.session(len(ids) + steps)
    logits, tokens, seen = session.prefill(ids), [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        seen.append(logits)
        logits = session.decode(tokens[-1])
    return tokens, seen


def check_greedy(reference, ids: list[int], tokens: list[int], logits: list[np.ndarray],
                 rel_tol: float = REL_TOL) -> None:
    """`tokens` must be what a teacher-forced reference forward picks (up to a near-tie, after
    which the continuations may part), with the same logits."""
    with torch.inference_mode():
        ref = reference(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float().numpy()
    for step, token in enumerate(tokens):
        assert rel(logits[step], ref[step]) <= rel_tol, f"step {step}"
        if token != int(ref[step].argmax()):
            top2 = np.sort(ref[step])[-2:]
            assert top2[1] - top2[0] <= TIE, f"step {step}: {token} vs {int(ref[step].argmax())}"
            break
