"""Kernels compiled into numba's on-disk cache ahead of use, in worker processes: every kernel of
pagelm.quant (`precompile`, on two), or the ones a model needs that the cache lacks (`compile_missing`,
on up to the kernel threads).

Without it, a fresh install (or CI's fresh clone) compiles each kernel inside the first call that
needs it, one at a time, in each process that needs it first (a server, a subprocess). numba keeps
one cache index per kernel function, holding all its specializations, and two processes adding to
one index at once lose one of the entries; so each process here compiles whole functions: one the
one-row GEMVs (exact and int8), the tile and the head kernels, the other the few-row GEMVs and the dequantizers
(cold, 150–200 s for both on this project's 2-core machine, half what it was before each few-row
kernel was built for one pass shape).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import importlib
import multiprocessing
import pickle
import subprocess
import sys
import time

import numpy as np


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


@dataclasses.dataclass(frozen=True)
class Job:
    """One warmup call (`module.function(*args)`) that compiles or loads whole kernel functions, `kernels` (their
    dispatchers, to tell whether the cache holds them); `label`: the block type or tile kind they are for. Two
    jobs never fill one kernel function: two processes adding to one numba index at once lose an entry."""

    module: str
    function: str
    args: tuple
    kernels: tuple
    label: str


def model_jobs(types, tables, tile_kinds, int8_types, dequantize_to) -> list[Job]:
    """The jobs of a model's kernels: matmul's GEMVs of `types` and of its head and embedding `tables` (and
    the dequantizers of `types` to `dequantize_to`), the tables' row gathers, its tiles', its int8 GEMVs."""
    from pagelm.quant import head, int8dot, matmul, tiles

    jobs = []
    for t in sorted(set(types) | (set(tables) & matmul.TABLE_TYPES)):
        (mv, mm), dequant, _ = matmul._block(t)
        parts = [("one-row", mv), ("few-row", mm)] + ([("dequantize", dequant)] if t in types else [])
        jobs += [Job("pagelm.quant.matmul", "warmup", ({t}, (part,), dequantize_to), (kernel,), t.name)
                 for part, kernel in parts]
    jobs += [Job("pagelm.quant.head", "warmup", ({t}, ("gather",)), (head._GATHER[t],), t.name)
             for t in sorted(set(tables) & set(head._GATHER))]
    jobs += [Job("pagelm.quant.tiles", "warmup", ({k}, dequantize_to), tiles._KERNELS[k], k.name) for k in sorted(tile_kinds)]
    jobs += [Job("pagelm.quant.int8dot", "warmup", ({t},), (int8dot._KERNELS[t],), t.name)
             for t in sorted(set(int8_types) & set(int8dot._KERNELS))]
    return jobs


def _cached(dispatcher) -> bool:
    """Whether numba's cache holds `dispatcher` compiled for this CPU (any signature: pagelm's kernels have one)."""
    try:
        magic = dispatcher.targetctx.codegen().magic_tuple()
        return any(key[1] == magic for key in dispatcher._cache._cache_file._load_index())
    except Exception:  # noqa: BLE001 - no cache, an unreadable index: a miss
        return False


def _run(job: tuple) -> None:
    module, function, args = job
    getattr(importlib.import_module(module), function)(*args)


def compile_missing(jobs: list[Job], workers: int) -> None:
    """Runs the jobs whose kernels the cache lacks in up to `workers` fresh interpreters at once (`python -m
    pagelm.quant.precompile JOB`: not multiprocessing's children, which would run the caller's main module again,
    a script's top-level load included), so that the caller's own warmups then load them; nothing where fewer than
    two such jobs or workers. A job that fails is left to the caller's warmup, which compiles it in process and
    raises what is wrong. An active CompileProgress counts them."""
    from pagelm.quant.compile_progress import announce

    if workers < 2:
        return
    missing = [job for job in jobs if not all(_cached(k) for k in job.kernels)]
    workers = min(workers, len(missing))
    if workers < 2:
        return
    progress = announce([job.label for job in missing], len(missing))
    pending, running = list(missing), []
    while pending or running:
        while pending and len(running) < workers:
            job = pending.pop(0)
            payload = base64.b64encode(pickle.dumps((job.module, job.function, job.args))).decode()
            running.append(subprocess.Popen([sys.executable, "-m", __name__, payload], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.05)
        for worker in [w for w in running if w.poll() is not None]:
            running.remove(worker)
            progress()


def compile_types(types, tables, dequantize_to, workers: int) -> None:
    """The kernels of block `types` (and of the head/embedding `tables`) the cache lacks, with a progress line: in
    worker processes where two or more can run, else here."""
    from pagelm.quant.compile_progress import CompileProgress

    jobs = model_jobs(types, tables, (), (), dequantize_to)
    with CompileProgress():
        compile_missing(jobs, workers)
        for job in jobs:  # what no worker compiled (one worker or none; a failed job) compiles here
            if not all(_cached(k) for k in job.kernels):
                _run((job.module, job.function, job.args))


def main(argv: list[str]) -> None:
    """`python -m pagelm.quant.precompile JOB` (a pickled job, base64) runs one worker's job; `… --types T,… --tables
    T,… --dtype bfloat16|float32` compiles a model file's block types (`pagelm pull`, which imports no numba)."""
    if argv[0] != "--types":
        _run(pickle.loads(base64.b64decode(argv[0])))
        return
    from pagelm.quant.types import GGMLType
    from pagelm.runtime.threads import kernel_threads

    named = dict(zip(argv[0::2], argv[1::2]))
    types, tables = ({GGMLType[t] for t in named[key].split(",") if t} for key in ("--types", "--tables"))
    compile_types(types, tables, (np.uint16,) if named["--dtype"] == "bfloat16" else (np.float32,), kernel_threads())


if __name__ == "__main__":
    main(sys.argv[1:])
