"""Kernels compiled into numba's on-disk cache ahead of use, in worker processes: every kernel of
pagelm.quant (`precompile`), or the ones a model needs that the cache lacks (`compile_missing`), on up to
the kernel threads.

Without it, a fresh install (or CI's fresh clone) compiles each kernel inside the first call that
needs it, one at a time, in each process that needs it first (a server, a subprocess). numba keeps
one cache index per kernel function, holding all its specializations, and two processes adding to
one index at once lose one of the entries; so a job compiles whole functions, and no two jobs the same one.
The workers take the jobs longest first, each worker one after another (a fresh interpreter and numba's
first compile cost ~1 s of CPU a process, which a process a job would pay for each of the suite's 50 jobs).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import pickle
import selectors
import subprocess
import sys

import numpy as np

DONE = b"pagelm-precompile: job done\n"  # a worker's line after each job (anything else it prints is not counted)


@dataclasses.dataclass(frozen=True)
class Job:
    """One warmup call (`module.function(*args)`) that compiles or loads whole kernel functions, `kernels` (their
    dispatchers, to tell whether the cache holds them); `label`: the block type or tile kind they are for (empty
    for a network's own kernels); `cost`: its compile time relative to the others' (the longest start first).
    Two jobs never fill one kernel function: two processes adding to one numba index at once lose an entry."""

    module: str
    function: str
    args: tuple
    kernels: tuple
    label: str
    cost: float = 1.0


# rough cold compile seconds of each kind of job (2-core Zen 4, numba 0.68.1: few-row, one-row, dequantize and
# gather as bench/compile_profile.py gave them on SmolLM2's Q8_0 and Q4_1; tile and int8 guessed): only the order counts
_COST = {"few-row": 5.0, "one-row": 2.0, "dequantize": 1.0, "gather": 0.3, "tile": 1.5, "int8": 1.5}


def model_jobs(types, tables, tile_kinds, int8_types, dequantize_to) -> list[Job]:
    """The jobs of a model's kernels: matmul's GEMVs of `types` and of its head and embedding `tables` (and
    the dequantizers of `types` to `dequantize_to`), the tables' row gathers, its tiles', its int8 GEMVs."""
    from pagelm.quant import head, int8dot, matmul, tiles

    jobs = []
    for t in sorted(set(types) | (set(tables) & matmul.TABLE_TYPES)):
        (mv, mm), dequant, _ = matmul._block(t)
        parts = [("one-row", mv), ("few-row", mm)] + ([("dequantize", dequant)] if t in types else [])
        jobs += [Job("pagelm.quant.matmul", "warmup", ({t}, (part,), dequantize_to), (kernel,), t.name,
                     _COST[part] * (len(dequantize_to) if part == "dequantize" else 1))
                 for part, kernel in parts]
    jobs += [Job("pagelm.quant.head", "warmup", ({t}, ("gather",)), (head._GATHER[t],), t.name, _COST["gather"])
             for t in sorted(set(tables) & set(head._GATHER))]
    jobs += [Job("pagelm.quant.tiles", "warmup", ({k}, dequantize_to), tiles._KERNELS[k], k.name, _COST["tile"])
             for k in sorted(tile_kinds)]
    jobs += [Job("pagelm.quant.int8dot", "warmup", ({t},), (int8dot._KERNELS[t],), t.name, _COST["int8"])
             for t in sorted(set(int8_types) & set(int8dot._KERNELS))]
    return jobs


def every_job() -> list[Job]:
    """The jobs of every kernel of pagelm.quant: each block type's GEMVs and dequantizers (to float32 and bf16),
    the tables' gathers, every tile kind's, the int8 GEMVs."""
    from pagelm.quant import int8dot, matmul, tiles

    return model_jobs(matmul._KERNELS, matmul.TABLE_TYPES, tiles.TileKind, int8dot._KERNELS, (np.float32, np.uint16))


def precompile(workers: int = 2) -> None:
    """Compiles (or finds in numba's cache) every kernel, in `workers` processes (an open CompileProgress counts
    them)."""
    _compile(every_job(), workers)


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


def _payload(job: Job) -> bytes:
    return base64.b64encode(pickle.dumps((job.module, job.function, job.args))) + b"\n"


def compile_missing(jobs: list[Job], workers: int) -> None:
    """Runs the jobs whose kernels the cache lacks, longest first, on up to `workers` fresh interpreters at once
    (`python -m pagelm.quant.precompile --jobs`, each taking the next job as it finishes one: not
    multiprocessing's children, which would run the caller's main module again, a script's top-level load
    included), so that the caller's own warmups then load them; nothing where fewer than two such jobs or
    workers. A job that fails is left to the caller's warmup, which compiles it in process and raises what is
    wrong. An active CompileProgress counts them."""
    from pagelm.quant.compile_progress import announce

    if workers < 2:
        return
    missing = [job for job in jobs if not all(_cached(k) for k in job.kernels)]
    workers = min(workers, len(missing))
    if workers < 2:
        return
    progress = announce(list(dict.fromkeys(job.label for job in missing if job.label)), len(missing))
    pending = sorted(missing, key=lambda job: -job.cost)
    with selectors.DefaultSelector() as ready:
        for _ in range(workers):
            worker = subprocess.Popen([sys.executable, "-m", __name__, "--jobs"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            ready.register(worker.stdout, selectors.EVENT_READ, worker)
            _next_job(worker, pending)
        while ready.get_map():
            for key, _ in ready.select():
                worker, line = key.data, key.fileobj.readline()
                if line == DONE:
                    progress()
                    _next_job(worker, pending)
                elif not line:  # all its jobs done (or it died: its job is left to the caller)
                    ready.unregister(key.fileobj)
                    worker.wait()


def _next_job(worker: subprocess.Popen, pending: list[Job]) -> None:
    """Hands `worker` the next pending job, or tells it there is none (it exits)."""
    try:
        if pending:
            worker.stdin.write(_payload(pending.pop(0)))
            worker.stdin.flush()
        else:
            worker.stdin.close()
    except BrokenPipeError:  # it died; its stdout's end removes it
        pass


def _serve_jobs() -> None:
    """A worker: runs each job read from stdin (a pickled job, base64, a line) and says when it is done."""
    for line in sys.stdin.buffer:
        try:
            _run(pickle.loads(base64.b64decode(line)))
        except Exception:  # noqa: BLE001 - the caller's warmup compiles it in process and raises what is wrong
            pass
        sys.stdout.buffer.write(DONE)
        sys.stdout.buffer.flush()


def _compile(jobs: list[Job], workers: int) -> None:
    """The kernels of `jobs` the cache lacks: in worker processes where two or more can run, else here."""
    compile_missing(jobs, workers)
    for job in jobs:  # what no worker compiled (one worker or none; a failed job) compiles here
        if not all(_cached(k) for k in job.kernels):
            _run((job.module, job.function, job.args))


def main(argv: list[str]) -> None:
    """`python -m pagelm.quant.precompile --jobs` is a worker (compile_missing's); `… --types T,… --tables T,…
    --dtype bfloat16|float32` compiles a model file's block types (`pagelm pull`, which imports no numba)."""
    if argv == ["--jobs"]:
        _serve_jobs()
        return
    from pagelm.quant.types import GGMLType
    from pagelm.runtime.threads import kernel_threads

    named = dict(zip(argv[0::2], argv[1::2]))
    types, tables = ({GGMLType[t] for t in named[key].split(",") if t} for key in ("--types", "--tables"))
    from pagelm.quant.compile_progress import CompileProgress

    dequantize_to = (np.uint16,) if named["--dtype"] == "bfloat16" else (np.float32,)
    with CompileProgress():
        _compile(model_jobs(types, tables, (), (), dequantize_to), kernel_threads())


if __name__ == "__main__":
    main(sys.argv[1:])
