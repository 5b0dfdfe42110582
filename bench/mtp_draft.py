"""Benchmark: what a draft from a Qwen3.5 file's multi-token-prediction layer costs beside a decode step:
median ms of a decode step, of the layer reading the pair that step made and guessing one token, of three
guesses (no pair to read), and of the output head alone (which every guess reads whole), after a seeded
--prompt-tokens prompt, the four called in turn --calls times, --threads threads:

    pagelm synth --shape qwen3.5-0.8b --mtp bench/models/qwen3.5-0.8b-mtp-q8_0.gguf
    .venv/bin/python bench/mtp_draft.py bench/models/qwen3.5-0.8b-mtp-q8_0.gguf
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from pagelm.engine.load import load_model
from pagelm.engine.speculate import MtpDraft, check_mode

sys.path.insert(0, os.path.dirname(__file__))
from head import median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file with an MTP layer (pagelm synth --mtp)")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = load_model(args.model, threads=args.threads)
    check_mode("mtp", model)
    session = model.session(args.prompt_tokens + args.calls + 16)
    drafter = MtpDraft.of(session)  # before the prefill: the layer reads the prompt's hidden states
    rng = np.random.default_rng(0)
    token = int(np.argmax(session.prefill(rng.integers(0, model.head.vocab_size, args.prompt_tokens).tolist())))
    drafter.draft([*session.tokens, token], 0, 1)
    held = {"token": token}
    hidden = rng.standard_normal(model.head.dim).astype(np.float32)

    def step() -> None:
        held["token"] = int(np.argmax(session.decode(held["token"])))

    def guesses(count: int):
        return lambda: drafter.draft([*session.tokens, held["token"]], 0, count)

    step_ms, one_ms, three_ms, head_ms = median_ms([step, guesses(1), guesses(3), lambda: model.head.logits(hidden)],
                                                   args.calls)
    print(f"{os.path.basename(args.model)}, {args.prompt_tokens}-token prompt, {args.threads} threads, "
          f"medians of {args.calls}")
    print(f"decode step {step_ms:.1f} ms; MTP: read a pair + 1 guess {one_ms:.1f} ms ({one_ms / step_ms:.2f} of a "
          f"step), 3 guesses {three_ms:.1f} ms; the output head alone {head_ms:.1f} ms")


if __name__ == "__main__":
    main()
