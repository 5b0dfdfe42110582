"""Benchmark: one DeltaNet decode token (pagelm.models.delta_rule.deltanet_tokens) of a Qwen3.5 geometry.

For each number of sequences n: the median ms of the token kernel over every DeltaNet layer of a
step, the states hot (one layer's states again and again) and as a decode step meets them (each
layer's own states in turn, every call after `--flush-mib` of other memory has been read, as the
weights' stream evicts them), with the GB/s of the states read and written (2 x n x nv x dk x dv x 4
bytes a layer). Random inputs; the kernel's arithmetic does not depend on them, but a decaying state
reaches subnormal floats, so the gates keep it at its scale.

    .venv/bin/python bench/deltanet.py [--shape qwen3.5-0.8b] [--sequences 1,4,8] [--calls 5] [--flush-mib 48]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from pagelm.runtime import threads
from pagelm.models.delta_rule import deltanet_tokens
from pagelm.tools.synth import SHAPES

sys.path.insert(0, os.path.dirname(__file__))
from head import median_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=[k for k, s in SHAPES.items() if s.full])
    ap.add_argument("--sequences", default="1,4,8", help="numbers of sequences a call advances")
    ap.add_argument("--calls", type=int, default=5, help="timed steps per case (median)")
    ap.add_argument("--flush-mib", type=int, default=48, help="memory read between the cold calls")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    threads.configure(args.threads)

    shape = SHAPES[args.shape]
    nk, nv, d = shape.ssm_k_heads, shape.ssm_v_heads, shape.ssm_head_dim
    channels, taps = shape.ssm_qkv_channels, shape.conv_kernel
    layers = sum(not shape.is_full_attention(i) for i in range(shape.n_layers))
    rng = np.random.default_rng(0)
    conv_w = torch.from_numpy(rng.standard_normal((taps, channels), np.float32) * 0.3)
    a, dt_bias = torch.full((nv,), -1e-3), torch.zeros(nv)  # decay ~0.999: the state stays at its scale
    norm_w = torch.ones(d)
    other = np.ones(args.flush_mib << 18, np.float32)

    print(f"{args.shape}: {layers} DeltaNet layers, {nv} value heads of {d}x{d}, {channels} conv channels, "
          f"{args.threads} threads, medians of {args.calls} steps\n")
    print("| sequences | hot ms/step | cold ms/step | cold GB/s of states |")
    print("|---:|---:|---:|---:|")
    for n in [int(s) for s in args.sequences.split(",")]:
        proj = torch.from_numpy(rng.standard_normal((n, channels + nv * d + 2 * nv), np.float32))
        convs = [[torch.zeros(taps - 1, channels) for _ in range(n)] for _ in range(layers)]
        states = [[torch.from_numpy(rng.standard_normal((nv, d, d), np.float32) * 0.01) for _ in range(n)]
                  for _ in range(layers)]

        def hot():
            for _ in range(layers):
                deltanet_tokens(proj, convs[0], conv_w, a, dt_bias, norm_w, states[0], nk, 1e-6, 1e-6)

        def cold() -> float:
            seconds = 0.0
            for layer in range(layers):
                other.sum()
                start = time.perf_counter()
                deltanet_tokens(proj, convs[layer], conv_w, a, dt_bias, norm_w, states[layer], nk, 1e-6, 1e-6)
                seconds += time.perf_counter() - start
            return seconds * 1e3

        hot()  # compiled, pages in
        hot_ms = median_ms([hot], args.calls)[0]
        cold_ms = float(np.median([cold() for _ in range(args.calls)]))
        moved = 2 * n * layers * nv * d * d * 4
        print(f"| {n} | {hot_ms:.2f} | {cold_ms:.2f} | {moved / cold_ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
