"""The one place that decides how many threads torch and the compiled kernels use.

torch's pool is process-wide; numba's count is per calling thread, so every thread that runs a
model (the server's engine thread included) calls `use()` before computing.
"""

from __future__ import annotations

import os

from pagelm.errors import PagelmError

_count: int | None = None


def available() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure(threads: int | None = None) -> int:
    """Set torch's and the kernels' thread count once (default: the CPUs this process may use)."""
    global _count
    n = available() if threads is None else threads
    if n < 1:
        raise PagelmError(f"threads must be at least 1, got {n}")
    import numba
    import torch

    n = min(n, numba.config.NUMBA_NUM_THREADS)  # numba's pool is sized at import
    torch.set_num_threads(n)
    _count = n
    use()
    return n


def use() -> None:
    """Apply the configured count to numba in the calling thread (torch's applies everywhere)."""
    if _count is not None:
        import numba

        if numba.get_num_threads() != _count:
            numba.set_num_threads(_count)


def kernel_threads() -> int:
    """The threads the compiled kernels run on: the configured count, else numba's in this thread
    (numba's getter costs ~0.7 us, and a decode step asks ~100 times)."""
    if _count is not None:
        return _count
    import numba

    return numba.get_num_threads()
