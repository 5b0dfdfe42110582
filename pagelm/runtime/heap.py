"""How freed memory goes back to the OS (glibc's mallopt and malloc_trim); a no-op elsewhere.

Large temporaries (a prefill's or a tower pass's activations, JSON parsed at load) are reused from
the heap while the work runs and leave free but resident heap behind; trimming after the work
keeps anonymous memory to what is really held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache

# Prefills shorter than this leave too little behind to be worth a trim.
TRIM_AFTER_TOKENS = 64
# Blocks at least this large are mapped on their own and unmapped when freed; smaller ones come from
# the heap, which keeps what is freed until `trim`. A prefill allocates and frees tens of GB of
# temporaries: given fresh mappings (glibc's default threshold starts at 128 KiB) every one of
# their pages is faulted in and zeroed again, 6.3 million faults and half the TTFT of 2,600 tokens
# on the 0.8B geometry; reused from the heap, 50 thousand. 32 MiB is the most glibc accepts, and a
# fixed threshold stops glibc's own moving one (which follows each large block freed).
MMAP_THRESHOLD = 32 << 20
# Free heap is given back only by `trim` (after a prefill, when a generation ends, when a server
# goes idle), never between one temporary and the next.
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers in glibc's malloc.h
_M_MMAP_THRESHOLD = -3


# oneDNN (torch's CPU GEMMs) keeps the last 1,024 GEMM primitives it made, each with buffers of its
# own, and torch's ideep layer above it as many of its own (LRU_CACHE_CAPACITY), one per GEMM shape:
# every new row count costs ~0.7 MiB for good (0.3 in ideep's). A mixture of experts' prefill makes one
# per expert and row count: after a 500-token prompt on the Qwen3-30B-A3B geometry they held 216 MiB
# (694 MiB anonymous in all, 478 with 16 kept, the TTFT the same); a server's prefills, one per prompt
# length. 64 keep what a dense model's prefill reuses (the Qwen3.5 0.8B's TTFT unchanged).
GEMM_PRIMITIVES = 64


def bound_gemm_cache() -> None:
    """Keep at most GEMM_PRIMITIVES oneDNN primitives and as many of ideep's (before the first GEMM; a
    setting the user made in the environment stays)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(GEMM_PRIMITIVES))


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
    """Fix the size from which blocks get their own mappings and keep freed heap until `trim`
    (once per process); False without glibc."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 \
        and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
