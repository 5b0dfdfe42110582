"""Benchmark: pagelm.quant.matmul over GGML block bytes vs torch.mv over unpacked bf16 / float32 copies.

Per block type and shape (rows x width): median ms of rows_matmul with one activation row, of
the opt-in int8-activation GEMV (weights "mapped-int8": quantizing the row included), of torch.mv
on the bf16 and float32 copies (2 threads each, calls alternating), the GB/s of the block bytes
read by rows_matmul, and rows_dequantize to bf16 in G weights/s. Random blocks: pagelm.quant.encode for the
types it encodes, random bytes with finite fp16 scales for the others. Prints one markdown table.
With --x-rows N (2 to 16) rows_matmul, the int8 GEMV and torch multiply N activation rows at once (the
batched decode's kernels; torch.mm for torch.mv).

    .venv/bin/python bench/matmul.py [--calls 30] [--types Q8_0 Q4_K ...] [--shapes 3584x1024 ...] [--x-rows 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import numba
import numpy as np
import torch

from pagelm.quant import BLOCK_LAYOUT, ENCODABLE, GGMLType, decode_bf16, encode
from pagelm.quant import int8dot
from pagelm.quant.matmul import MAX_GEMV_ROWS, check_rows, rows_dequantize, rows_matmul, warmup
from pagelm.quant.types import SCALE_FIELDS

sys.path.insert(0, os.path.dirname(__file__))
from head import median_ms  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
SHAPES = ["3584x1024", "1024x3584"]
HEAD = "248320x1024"  # Q8_0 only
STEP = 16384  # rows generated at a time


def random_rows(rng: np.random.Generator, t: GGMLType, rows: int, width: int) -> np.ndarray:
    if t in ENCODABLE:
        return encode(rng.standard_normal((rows, width), np.float32), t)
    block_values, block_bytes = BLOCK_LAYOUT[t]
    raw = rng.integers(0, 256, (rows, width // block_values * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for at in SCALE_FIELDS[t]:
        blocks[:, at : at + 2] = rng.uniform(1e-3, 4e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw


def bench(t: GGMLType, rows: int, width: int, calls: int, x_rows: int = 1) -> str:
    rng = np.random.default_rng(0)
    table = np.concatenate([random_rows(rng, t, min(STEP, rows - i), width) for i in range(0, rows, STEP)])
    data = table.reshape(-1)
    data.flags.writeable = False  # as the file map is
    offs = np.arange(rows, dtype=np.int64) * table.shape[1]
    check_rows(data, t, offs, width)
    x = rng.standard_normal((x_rows, width), np.float32)
    out = np.empty((x_rows, rows), np.float32)
    dense = torch.from_numpy(decode_bf16(table, t).view(np.int16)).view(torch.bfloat16)
    dense32 = dense.float()
    x32 = torch.from_numpy(x[0]) if x_rows == 1 else torch.from_numpy(x).T
    xb = x32.to(torch.bfloat16)
    product = torch.mv if x_rows == 1 else torch.mm
    int8 = int8dot.bound_rows_matmul_int8(data, t, offs, width) if t in int8dot.INT8_TYPES else None
    ms, int8_ms, bf16_ms, f32_ms = median_ms(
        [
            lambda: rows_matmul(data, t, offs, width, x, out),
            (lambda: int8(int8dot.Int8Rows(x), out, 0)) if int8 else (lambda: None),
            lambda: product(dense, xb),
            lambda: product(dense32, x32),
        ],
        calls,
    )
    del dense32
    tile = min(rows, 4096)  # as prefill dequantizes a tile into a reused scratch
    scratch = np.empty((tile, width), np.uint16)
    (dq_ms,) = median_ms([lambda: rows_dequantize(data, t, offs[:tile], width, scratch)], calls)
    return (
        f"| {t.name} | {rows}x{width} | {ms:.3f} | {f'{int8_ms:.3f}' if int8 else '-'} | {bf16_ms:.3f} "
        f"| {ms / bf16_ms:.2f} | {f32_ms:.3f} "
        f"| {data.size / ms / 1e6:.1f} | {tile * width / dq_ms / 1e6:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--types", nargs="+", default=TYPES)
    p.add_argument("--shapes", nargs="+", default=SHAPES + [HEAD])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--x-rows", type=int, default=1, help="activation rows multiplied at once (1 to 16)")
    a = p.parse_args()
    if not 1 <= a.x_rows <= MAX_GEMV_ROWS:
        p.error(f"--x-rows must be 1 to {MAX_GEMV_ROWS}, got {a.x_rows}")
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    warmup()
    int8dot.warmup()
    print(f"threads {a.threads}, numba {numba.__version__}, torch {torch.__version__}, median of {a.calls} calls, "
          f"{a.x_rows} activation row(s)")
    op = "mv" if a.x_rows == 1 else "mm"
    print(f"| type | rows x width | matmul ms | int8 ms | torch bf16 {op} ms | ratio | torch f32 {op} ms | GB/s | dequant bf16 Gw/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.types:
        for shape in a.shapes:
            if shape == HEAD and name != "Q8_0":
                continue
            rows, width = map(int, shape.split("x"))
            print(bench(GGMLType[name], rows, width, a.calls, a.x_rows), flush=True)


if __name__ == "__main__":
    main()
