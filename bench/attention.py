"""Benchmark: the decode token's attention kernel (token_ops.attend_heads) over a bf16 KV cache, by rows
(tokens of one sequence, as a verify pass feeds them; 1 is a decode step) and by positions already in the
cache: median ms a call of --calls, 2 threads (runtime.threads). Random queries, keys and values; the
shape (query heads, KV heads, head dim) defaults to SmolLM2's. Compare trees with PYTHONPATH:

    for tree in /tmp/before .; do PYTHONPATH=$tree .venv/bin/python bench/attention.py [--shape 9,3,64]; done
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from pagelm.models.token_ops import attend_heads
from pagelm.runtime import threads

sys.path.insert(0, os.path.dirname(__file__))
from head import median_ms  # noqa: E402


def call_ms(H: int, G: int, D: int, rows: int, positions: int, calls: int) -> float:
    length = positions + rows
    gen = torch.Generator().manual_seed(rows * 7919 + positions)
    ck, cv = (torch.randn(G, length, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, H, D, generator=gen).numpy()
    k, v = (torch.randn(rows, G, D, generator=gen).numpy() for _ in range(2))
    ks, vs = np.full(rows, ck.data_ptr(), np.int64), np.full(rows, cv.data_ptr(), np.int64)
    like = np.zeros(1, np.uint16)
    lens, lo = np.full(rows, length, np.int64), np.zeros(rows, np.int64)
    pos = np.arange(positions, positions + rows, dtype=np.int64)
    out = np.zeros((rows, H * D), np.float32)

    def once() -> None:
        attend_heads(q, k, v, ks, vs, like, lens, pos, lo, np.float32(D**-0.5), out)

    once()
    return median_ms([once], calls)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head dim (default SmolLM2's 9,3,64)")
    parser.add_argument("--rows", default="1,4,16", help="rows a call (default 1,4,16)")
    parser.add_argument("--positions", default="200,1000", help="positions in the cache (default 200,1000)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    H, G, D = (int(n) for n in args.shape.split(","))
    threads.use()
    positions = [int(p) for p in args.positions.split(",")]
    print(f"attend_heads, {H} query heads, {G} KV heads, head dim {D}, bf16 cache: median ms a call")
    print("| rows | " + " | ".join(f"{p} positions" for p in positions) + " |")
    print("|---:|" + "---:|" * len(positions))
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"| {rows} | " + " | ".join(f"{call_ms(H, G, D, rows, p, args.calls):.3f}" for p in positions) + " |")


if __name__ == "__main__":
    main()
