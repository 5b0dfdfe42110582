"""Giving freed heap memory back to the OS (glibc's malloc_trim); a no-op elsewhere.

Large temporaries (a prefill's activations, JSON parsed at load) leave free but resident heap
behind; trimming after them keeps anonymous memory to what is really held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

# Prefills shorter than this leave too little behind to be worth a trim.
TRIM_AFTER_TOKENS = 64


@lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def trim() -> None:
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
