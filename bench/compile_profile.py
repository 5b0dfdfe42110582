"""Benchmark: where a cold first answer's kernel compilation goes. In one process (no worker processes: one
kernel thread), loads MODEL into an empty kernel cache, prefills 19 tokens and decodes one, and prints the
CPU seconds numba spent compiling each function (a function's own, its callees' subtracted), largest first.

    PAGELM_CACHE=$(mktemp -d) .venv/bin/python bench/compile_profile.py MODEL [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
from numba.core import event

import pagelm


class CompileTimes(event.Listener):
    """Each compiled function's own CPU seconds and count, from numba's nested compile events."""

    def __init__(self):
        self.stack: list[list] = []
        self.own: collections.Counter = collections.Counter()
        self.count: collections.Counter = collections.Counter()

    def on_start(self, ev) -> None:
        self.stack.append([ev.data["dispatcher"].py_func.__qualname__, time.process_time(), 0.0])

    def on_end(self, ev) -> None:
        name, start, callees = self.stack.pop()
        spent = time.process_time() - start
        self.own[name] += spent - callees
        self.count[name] += 1
        if self.stack:
            self.stack[-1][2] += spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    times = CompileTimes()
    with event.install_listener("numba:compile", times):
        model = pagelm.load(args.model, threads=1)
        session = model.session(max_len=64)
        session.decode(int(np.argmax(session.prefill(list(range(1, 20))))))
    print(f"compiled CPU {sum(times.own.values()):.1f} s in {sum(times.count.values())} compilations")
    for name, seconds in times.own.most_common(args.top):
        print(f"{seconds:7.2f} s  x{times.count[name]}  {name}")


if __name__ == "__main__":
    main()
