"""How freed memory goes back to the OS (glibc's mallopt and malloc_trim); a no-op elsewhere.

Large temporaries (a prefill's or a tower pass's activations, JSON parsed at load) leave free
but resident heap behind; large blocks get their own mappings and trimming after the rest keeps
anonymous memory to what is really held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

# Prefills shorter than this leave too little behind to be worth a trim.
TRIM_AFTER_TOKENS = 64
# Blocks at least this large are mapped on their own and unmapped when freed. glibc's default
# starts here too but raises itself to each large block freed (up to 32 MiB), after which a
# prefill's activations come from the heap, where frees in one thread's arena cannot serve
# another's and the peak grows by what lies free (measured: a 640×480 image through the 0.8B
# tower peaked 184 MiB above its start with the moving threshold, 104 MiB with this one).
MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


@lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc
        return None


def trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@lru_cache(maxsize=1)
def map_large_blocks() -> bool:
    """Fix the size from which blocks get their own mappings (once per process); False without glibc."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
