"""Every kernel of pagelm.quant compiled into numba's on-disk cache ahead of use, on two processes.

Without it, a fresh install (or CI's fresh clone) compiles each kernel inside the first call that
needs it, one at a time, in each process that needs it first (a server, a subprocess). numba keeps
one cache index per kernel function, holding all its specializations, and two processes adding to
one index at once lose one of the entries; so each process here compiles whole functions: one the
one-row GEMVs (exact and int8), the tile and the head kernels, the other the few-row GEMVs and the dequantizers
(cold, 150–200 s for both on this project's 2-core machine, half what it was before each few-row
kernel was built for one pass shape).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing


def _one_row() -> None:
    from pagelm.quant import head, int8dot, matmul, tiles

    head.warmup()
    tiles.warmup(tiles.TileKind)
    matmul.warmup(parts=("one-row",))
    int8dot.warmup()


def _the_rest() -> None:
    from pagelm.quant import matmul

    matmul.warmup(parts=("few-row", "dequantize"))


def _reporting(job) -> None:
    """`job` with its process's line on stderr while it compiles (none when all is cached)."""
    from pagelm.quant.compile_progress import CompileProgress

    with CompileProgress(live=False):
        job()


def precompile() -> None:
    """Compiles (or finds in numba's cache) every kernel, the two halves on two fresh processes at once."""
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in [pool.submit(_reporting, job) for job in (_one_row, _the_rest)]:
            done.result()
