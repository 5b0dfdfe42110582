"""Benchmark: decode step time of two or more source trees of pagelm side by side.

One worker process per tree (the tree first on PYTHONPATH) loads MODEL once, prefills N sessions,
then waits; the driver has the workers run ROUNDS rounds of --steps greedy decode steps each, one
worker at a time, in alternating order, so that a shared host's slow moments fall on every tree
alike. Prints each tree's median and minimum ms per step (one step: one token of each of the N
sequences, one decode_batch call; session.decode at N = 1). Compare a change against a worktree
of the commit before it:

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/ab_decode.py smollm2-135m /tmp/before . [--sequences 4] [--rounds 15]

MODEL as `pagelm bench batch` takes it (a synthetic shape, a known model, a .gguf path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(model_path: str, sequences: int, steps: int) -> None:
    import numpy as np

    import pagelm

    model = pagelm.load(model_path, dtype="bfloat16")
    sessions = [model.session(max_len=4096) for _ in range(sequences)]
    logits = [s.prefill(list(range(100 + i, 140 + 3 * i))) for i, s in enumerate(sessions)]

    def run(k: int) -> None:
        nonlocal logits
        for _ in range(k):
            tokens = [int(np.argmax(row)) for row in logits]
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.sequences, args.steps)
        return
    from pagelm.bench.inputs import model_path

    path = model_path(args.model)
    procs = []
    for tree in args.trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), path, tree, "--worker",
                                       "--sequences", str(args.sequences), "--steps", str(args.steps)],
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
    print(f"{path}, {args.sequences} sequence(s), {args.rounds} rounds of {args.steps} steps, ms per step")
    print("| tree | median | min |\n|---|---:|---:|")
    for tree, values in zip(args.trees, times):
        print(f"| {tree} | {statistics.median(values):.2f} | {min(values):.2f} |")


if __name__ == "__main__":
    main()
