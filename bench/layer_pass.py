"""Benchmark: every layer matrix of a model, read once in the model's order, as its weights mapped.

Two passes per model over the operators `pagelm.load` made (the output head excluded): the GEMV
pass multiplies one activation row by each (a decode step's matmuls without the rest of the step),
the dequantization pass writes each matrix to bf16 in the row tiles a prefill GEMM takes (what
mapped mode adds to a prefill segment). A Qwen3.5 geometry's layers (0.3-1.4 GiB) are far larger than
the caches, so each matrix comes from memory, as in decode; the small real models' (~65 MiB) may
stay in a large L3 between passes. Medians of --passes passes after one warm-up; GB/s counts the
file bytes read. Prints one markdown table.

    .venv/bin/python bench/layer_pass.py MODEL [MODEL ...] [--passes 7] [--threads 2]

MODEL: a .gguf path or a store name (pulled when missing).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

import pagelm
from pagelm.sources import store
from pagelm.quant.types import as_ggml_type, row_nbytes
from pagelm.weights.linear import MappedLinear, RowGroup, tile_rows

sys.path.insert(0, os.path.dirname(__file__))
from head import median_ms  # noqa: E402

MIB = 1024 * 1024


def _passes(fn, passes: int) -> float:
    """Median seconds of `passes` calls after a warm-up (page faults on the map, first calls)."""
    fn()
    return median_ms([fn], passes)[0] / 1e3


def bench(name: str, passes: int, threads: int) -> str:
    path = name if name.endswith(".gguf") else str(store.pull(name))
    model = pagelm.load(path, threads=threads)
    ops = [op for op in model.loader.operators if isinstance(op, MappedLinear)]
    parts = [p for op in ops for p in op.parts]
    if not all(isinstance(p, RowGroup) for p in parts):
        raise SystemExit(f"{name}: only GGML row matrices are measured here")
    nbytes = sum(p.rows * row_nbytes(p.ggml_type, p.width) for p in parts)
    values = sum(p.rows * p.width for p in parts)
    rng = np.random.default_rng(0)
    rows = [torch.from_numpy(rng.standard_normal((1, op.in_features), np.float32)) for op in ops]
    scratch = np.empty(max(tile_rows(op.in_features) * op.in_features for op in ops), np.uint16)

    def gemvs():
        for op, x in zip(ops, rows):
            op(x)

    def dequantize():
        for op in ops:
            step = tile_rows(op.in_features)
            for p in op.parts:
                for lo in range(0, p.rows, step):
                    hi = min(lo + step, p.rows)
                    p.dequantize(lo, hi, scratch[: (hi - lo) * p.width].reshape(hi - lo, p.width))

    gemv_s, dequant_s = _passes(gemvs, passes), _passes(dequantize, passes)
    kinds = "/".join(sorted({as_ggml_type(p.ggml_type).name for p in parts}))
    return (f"| {os.path.basename(path)} | {kinds} | {len(ops)} | {nbytes / MIB:.0f} | {gemv_s * 1e3:.1f} "
            f"| {nbytes / gemv_s / 1e9:.1f} | {dequant_s * 1e3:.1f} | {values / dequant_s / 1e9:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    print(f"threads {a.threads}, median of {a.passes} passes after a warm-up")
    print("| model | types | operators | MiB read | GEMV pass ms | GB/s | bf16 dequantization pass ms | G values/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in a.models:
        print(bench(name, a.passes, a.threads), flush=True)


if __name__ == "__main__":
    main()
