"""The float32 FMA peak of this machine's threads, as the kernels' compiler targets them: the
yardstick `bench batch` sets its matmuls' GFLOP/s against. Measures; computes nothing a model uses.

Each thread runs independent chains of vector FMAs on registers (no memory traffic): enough chains
to cover the FMA units' latency, few enough to stay in registers (12 <16 x float> under AVX-512,
5 under AVX2, whose 16 registers hold 10 halves of them plus the two operands).
"""

from __future__ import annotations

import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from pagelm.quant.blockir import acc_vectors, acc_zero, fma16, splat_f32, vector_at
from pagelm.quant.codegen import wide_vectors
from pagelm.quant.matmul import AVX512

CHAINS = 12 if AVX512 else 5
LANES = 16


@intrinsic
def _fma_round(typingctx, acc, chains, w, c):
    """acc[k] = fma(acc[k], w, c) for each of the `chains` (a constant) <16 x float> at acc."""
    if not isinstance(chains, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        accp, _, w, c = args
        fma = fma16(builder)
        ws, cs = splat_f32(builder, w), splat_f32(builder, c)
        for k in range(chains.literal_value):
            ap = vector_at(builder, accp, k)
            builder.store(builder.call(fma, [builder.load(ap), ws, cs]), ap)
        return context.get_dummy_value()

    return types.void(acc, chains, w, c), codegen


@intrinsic
def _first_lanes(typingctx, acc, chains, out):
    """out[k] = lane 0 of accumulator k, for each of the `chains` (a constant); out a 1-D float32 array."""
    if not isinstance(chains, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[2])(context, builder, args[2]).data
        for k in range(chains.literal_value):
            lane = builder.extract_element(builder.load(vector_at(builder, args[0], k)), ir.IntType(32)(0))
            builder.store(lane, builder.gep(data, [ir.IntType(32)(k)]))
        return context.get_dummy_value()

    return types.void(acc, chains, out), codegen


@njit(parallel=True, cache=True)
def _chains(rounds, w, c, out):
    """out[t, k] = lane 0 of chain k of thread t after `rounds` of acc = fma(acc, w, c) from 0."""
    for t in prange(out.shape[0]):
        wide_vectors()
        acc = acc_vectors(CHAINS)
        acc_zero(acc, 1, CHAINS)
        for _ in range(rounds):
            _fma_round(acc, CHAINS, w, c)
        _first_lanes(acc, CHAINS, out[t])


def chain_values(rounds: int, w: float, c: float, threads: int) -> np.ndarray:
    """Every thread's chains after `rounds` FMAs (what the measurement computes), for tests."""
    out = np.empty((threads, CHAINS), np.float32)
    _chains(rounds, np.float32(w), np.float32(c), out)
    return out


def fma_peak_gflops(threads: int | None = None, seconds: float = 0.2) -> float:
    """GFLOP/s (an FMA is 2) of `threads` (default: numba's) running FMA chains at once, the best
    of 3 runs of about `seconds` each; w = 1 and c = 1 keep every value an exact small integer."""
    threads = threads or numba.get_num_threads()
    out = np.empty((threads, CHAINS), np.float32)
    one = np.float32(1)
    _chains(1000, one, one, out)  # compiled, and the clock ramped
    rounds = 1000
    while True:  # grow the run to about `seconds`
        start = time.perf_counter()
        _chains(rounds, one, one, out)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 4 or rounds >= 1 << 22:  # 2^22 rounds: still exact in float32
            break
        rounds *= 2
    rounds = min(int(rounds * seconds / max(elapsed, 1e-9)), 1 << 23)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        _chains(rounds, one, one, out)
        best = max(best, 2 * LANES * CHAINS * rounds * threads / (time.perf_counter() - start) / 1e9)
    return best
