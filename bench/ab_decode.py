"""Benchmark: decode step time of two or more source trees of pagelm side by side.

One worker process per tree (the tree first on PYTHONPATH) loads MODEL once, prefills N sessions,
then waits; the driver has the workers run ROUNDS rounds of --steps greedy decode steps each, one
worker at a time, in alternating order, so that a shared host's slow moments fall on every tree
alike. Prints each tree's median and minimum ms per step (one step: one token of each of the N
sequences, one decode_batch call; session.decode at N = 1; with --rows K, one sequence's verify pass
of K rows, as speculation's, rewound to its first). --context: the prompt's tokens before the steps
(seeded random ids; default 40 to 46). Compare a change against a worktree of the commit before it:

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/ab_decode.py smollm2-135m /tmp/before . [--sequences 4] [--rounds 15] \
        [--context 1000] [--rows 16] [--weights mapped-int8]

MODEL as `pagelm bench batch` takes it (a synthetic shape, a known model, a .gguf path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(model_path: str, sequences: int, steps: int, context: int | None, rows: int, weights: str) -> None:
    import numpy as np

    import pagelm

    model = pagelm.load(model_path, dtype="bfloat16", weights=weights)
    sessions = [model.session(max_len=4096 + (context or 0)) for _ in range(sequences)]
    prompts = [list(range(100 + i, 140 + 3 * i)) if context is None else
               np.random.default_rng(i).integers(100, 20000, context).tolist() for i in range(sequences)]
    logits = [s.prefill(p) for s, p in zip(sessions, prompts)]

    def run(k: int) -> None:
        nonlocal logits
        for _ in range(k):
            tokens = [int(np.argmax(row)) for row in logits]
            if rows > 1:
                logits = [sessions[0].verify(tokens * rows)[0]]
                sessions[0].rewind(1)
            else:
                logits = [sessions[0].decode(tokens[0])] if sequences == 1 else model.decode_batch(sessions, tokens)

    run(5)  # kernels loaded, pages in
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        run(steps)
        print((time.perf_counter() - start) / steps * 1e3, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("trees", nargs="+", help="source trees (a worktree's root), each run in its own process")
    parser.add_argument("--sequences", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds, each tree once a round (default 15)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps a turn (default 20)")
    parser.add_argument("--context", type=int, help="prompt tokens before the steps (default 40 to 46)")
    parser.add_argument("--rows", type=int, default=1, help="rows of each step's verify pass (one sequence; default 1: "
                                                           "decode steps)")
    parser.add_argument("--weights", default="mapped", help="mapped (default), mapped-int8 or dense")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from pagelm.weights.linear import MAX_GEMV_ROWS

    if not (1 <= args.rows <= MAX_GEMV_ROWS) or (args.rows > 1 and args.sequences != 1):
        parser.error(f"--rows must be 1 to {MAX_GEMV_ROWS}, and more than 1 only with one sequence")
    if args.worker:
        worker(args.model, args.sequences, args.steps, args.context, args.rows, args.weights)
        return
    from pagelm.bench.inputs import model_path

    path = model_path(args.model)
    procs = []
    for tree in args.trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), path, tree, "--worker",
                                       "--sequences", str(args.sequences), "--steps", str(args.steps),
                                       "--rows", str(args.rows), "--weights", args.weights,
                                       *(() if args.context is None else
                                                                   ("--context", str(args.context)))],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for tree, p in zip(args.trees, procs):
        if p.stdout.readline().strip() != "ready":
            sys.exit(f"ab_decode: the worker of {tree} did not start")
    times: list[list[float]] = [[] for _ in args.trees]  # by position: a tree twice measures the noise
    order = list(zip(args.trees, times, procs))
    for r in range(args.rounds):
        print(f"ab_decode: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for tree, values, p in order if r % 2 == 0 else order[::-1]:
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                sys.exit(f"ab_decode: the worker of {tree} stopped (its error is above)")
            values.append(float(line))
    for p in procs:
        p.stdin.close()
        p.wait()
    what = f"verify passes of {args.rows} rows" if args.rows > 1 else f"{args.sequences} sequence(s)"
    print(f"{path}, {what}, {args.rounds} rounds of {args.steps} steps, weights {args.weights}, ms per step")
    print("| tree | median | min |\n|---|---:|---:|")
    for tree, values in zip(args.trees, times):
        print(f"| {tree} | {statistics.median(values):.2f} | {min(values):.2f} |")


if __name__ == "__main__":
    main()
