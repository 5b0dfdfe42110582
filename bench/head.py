"""Benchmark: output-head logits over the mapped quantized table vs torch.mv over an unpacked bf16 copy.

For each shape, writes a random table to a temp GGUF and maps it read-only (the write leaves it in
the page cache), then times pagelm's head_logits and torch.mv (2 threads each, calls alternating,
median of --calls each) and a single-row bf16 gather (kernel vs numpy decode_bf16, median over
batches of 100 random rows). Prints one markdown table.

    .venv/bin/python bench/head.py [--calls 25] [--shapes 248320x1024:Q8_0 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from pagelm.formats.gguf import GGUFFile, TensorToWrite, write_gguf
from pagelm.quant import BLOCK_LAYOUT, GGMLType, decode_bf16, row_nbytes
from pagelm.quant.head import gather_rows_bf16, head_logits, warmup

SHAPES = ["248320x1024:Q8_0", "248320x2048:Q8_0", "248320x1024:Q6_K"]
# Byte offset of the fp16 scale d in each block; set to a finite value so no logit is NaN.
SCALE_AT = {GGMLType.Q8_0: 0, GGMLType.Q6_K: 208}
MIB = 1024 * 1024


def random_rows(rng: np.random.Generator, t: GGMLType, rows: int, dim: int) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, row_nbytes(t, dim)), dtype=np.uint8)
    blocks = raw.reshape(-1, BLOCK_LAYOUT[t][1])
    at = SCALE_AT[t]
    blocks[:, at : at + 2] = rng.uniform(1e-3, 4e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw


def write_table(path: str, t: GGMLType, vocab: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    step = 16384
    chunks = (random_rows(rng, t, min(step, vocab - i), dim) for i in range(0, vocab, step))
    write_gguf(path, {"general.architecture": "bench"}, [TensorToWrite("token_embd.weight", (dim, vocab), t, chunks)])


def median_ms(fns: list, calls: int) -> list[float]:
    """Median ms per call of each of `fns`, called in turn so that all see the same background load."""
    times = [[] for _ in fns]
    for _ in range(calls):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [float(np.median(ts)) * 1e3 for ts in times]


def per_call_us(fn, args: list, batch: int = 100) -> float:
    """Median over batches of `batch` calls, one call per element of `args`."""
    times = []
    for i in range(0, len(args), batch):
        part = args[i : i + batch]
        start = time.perf_counter()
        for a in part:
            fn(a)
        times.append((time.perf_counter() - start) / len(part))
    return float(np.median(times)) * 1e6


def bench_shape(shape: str, tmp: str, calls: int) -> str:
    size, tname = shape.split(":")
    vocab, dim = map(int, size.split("x"))
    t = GGMLType[tname]
    path = os.path.join(tmp, f"{shape.replace(':', '-')}.gguf")
    write_table(path, t, vocab, dim)
    with GGUFFile.open(path) as f:
        table = f.tensor_data("token_embd.weight").reshape(vocab, -1)
        x = np.random.default_rng(1).standard_normal(dim).astype(np.float32)
        out = np.empty(vocab, np.float32)
        dense = torch.from_numpy(decode_bf16(table, t).view(np.int16)).view(torch.bfloat16)
        xt = torch.from_numpy(x).to(torch.bfloat16)
        head_logits(table, t, x, out)
        torch.mv(dense, xt)
        pagelm_ms, torch_ms = median_ms([lambda: head_logits(table, t, x, out), lambda: torch.mv(dense, xt)], calls)
        del dense

        ids = [np.array([i], np.int64) for i in np.random.default_rng(2).integers(0, vocab, 5000)]
        row = np.empty((1, dim), np.uint16)
        kernel_us = per_call_us(lambda i: gather_rows_bf16(table, t, i, row), ids)
        numpy_us = per_call_us(lambda i: decode_bf16(table[i], t, out=row), ids)
        del table
    os.remove(path)
    return (
        f"| {vocab:,} × {dim:,} | {t.name} | {vocab * row_nbytes(t, dim) / MIB:.0f} | {pagelm_ms:.1f} "
        f"| {torch_ms:.1f} | {pagelm_ms / torch_ms:.2f} | {kernel_us:.2f} | {numpy_us:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="VOCABxDIM:TYPE, TYPE one of Q8_0, Q6_K")
    parser.add_argument("--calls", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(2)
    warmup()
    print("| vocab × dim | type | table MiB | pagelm head ms | torch bf16 mv ms | pagelm/torch "
          "| gather 1 row µs (kernel) | gather 1 row µs (numpy) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            print(bench_shape(shape, tmp, args.calls), flush=True)


if __name__ == "__main__":
    main()
