"""Benchmark: what a new process pays on its first one-token decode step, after loading a model and
an 8-token prefill: that step's seconds, the next step's, the anonymous memory the first one added,
and the numba compilations it ran (0 when every compiled function came from the cache); and the load's
seconds, which include a warmup step (engine.load: what a step loads from the kernel cache is loaded
there). Run it twice: the second run is the warm-cache figure.

    .venv/bin/python bench/first_step.py MODEL [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba.core import event

import pagelm
from pagelm.measure.memory import MIB, read_memory


class _Compilations(event.Listener):
    def __init__(self):
        self.count = 0

    def on_start(self, ev):
        self.count += 1

    def on_end(self, ev):
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    start = time.perf_counter()
    model = pagelm.load(a.model, threads=a.threads)
    load_s = time.perf_counter() - start
    session = model.session(max_len=16)
    logits = session.prefill(list(range(1, 9)))
    before, compilations = read_memory().anonymous, _Compilations()
    start = time.perf_counter()
    with event.install_listener("numba:compile", compilations):
        logits = session.decode(int(np.argmax(logits)))
    first = time.perf_counter() - start
    added = read_memory().anonymous - before
    start = time.perf_counter()
    session.decode(int(np.argmax(logits)))
    print(f"load {load_s:.2f} s; first decode step {first * 1000:.1f} ms ({compilations.count} numba compilations, +{added / MIB:.1f} MiB "
          f"anonymous); the next {(time.perf_counter() - start) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
