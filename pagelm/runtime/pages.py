"""Zeroed memory whose pages the OS supplies when first written (an anonymous mapping of its own),
and how much of it is resident.

A KV cache is reserved for a whole context but written a position at a time: in such a buffer a
4,096-token session that has seen 500 tokens holds the pages of 500 positions, not of 4,096.
(torch.zeros and calloc from the heap write every byte up front.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from functools import lru_cache

import numpy as np
import torch


def zeroed(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes zeros in a mapping of its own, resident only where written;
    the mapping lives as long as the tensor and its views."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


class ZeroedTensors:
    """`count` zero tensors of `shape` and `dtype` (`tensors`): on the CPU views of one zeroed()
    buffer, whose resident bytes `nbytes` reports; elsewhere torch.zeros, all counted."""

    def __init__(self, shape: tuple[int, ...], count: int, dtype: torch.dtype, device: torch.device):
        if device.type != "cpu":
            self._buffer = None
            self.tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
            return
        size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        self._buffer = zeroed(size * count)
        self.tensors = [self._buffer[k * size : (k + 1) * size].view(dtype).view(shape) for k in range(count)]

    @property
    def nbytes(self) -> int:
        if self._buffer is None:
            return sum(t.numel() * t.element_size() for t in self.tensors)
        return resident_bytes(self._buffer)


@lru_cache(maxsize=1)
def _mincore():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    if libc is None or not hasattr(libc, "mincore"):
        return None
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc.mincore


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under CPU tensor `t` (contiguous) that are resident, by mincore(2); the
    tensor's size where that cannot be asked (not Linux, not the CPU)."""
    size = t.numel() * t.element_size()
    mincore = _mincore()
    if mincore is None or t.device.type != "cpu" or size == 0:
        return size
    first = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    pages = (t.data_ptr() + size - first + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = np.zeros(pages, np.uint8)
    if mincore(first, pages * mmap.PAGESIZE, vector.ctypes.data) != 0:
        return size
    return int(np.count_nonzero(vector & 1)) * mmap.PAGESIZE
