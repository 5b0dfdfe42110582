"""Tensors viewed in place in the read-only map of their file, and the page spans of their rows.

Owns `MappedTensor` and `page_spans`; never copies a tensor and never does model math.
"""

from __future__ import annotations

import mmap

import numpy as np

from pagelm.errors import PagelmError
from pagelm.formats.gguf import GGUFFile


def page_spans(offset: int, row_nbytes: int, rows: np.ndarray, page_size: int = mmap.PAGESIZE):
    """Page-aligned, coalesced (start, length) byte spans covering the given rows of a table
    whose row 0 starts at file offset `offset`. Rows may repeat and come in any order."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if rows.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    starts = (offset + rows * row_nbytes) // page_size * page_size
    ends = -(-(offset + (rows + 1) * row_nbytes) // page_size) * page_size
    # rows are sorted, so a span opens where a start lies past every end before it
    reach = np.maximum.accumulate(ends)
    opens = np.concatenate(([True], starts[1:] > reach[:-1]))
    first = np.flatnonzero(opens)
    last = np.concatenate((first[1:] - 1, [rows.size - 1]))
    return starts[first], reach[last] - starts[first]


class MappedTensor:
    """A 2-D tensor (rows × row bytes) viewed in place in the read-only map of its file."""

    def __init__(self, model: GGUFFile, name: str):
        if name not in model.tensors:
            raise PagelmError(f"{model.name}: tensor '{name}' not found")
        info = model.tensors[name]
        self.name = name
        self.file_name = model.name
        self.ggml_type = info.ggml_type
        self.offset = info.offset
        self.row_values = info.dims[0]
        self.row_nbytes = info.row_nbytes
        self.rows = info.n_elements // info.dims[0]
        self.raw = model.tensor_data(name).reshape(self.rows, self.row_nbytes)
        self._map = model.tensor_buffer(name)[1]

    def advise(self, advice: int, starts=None, lengths=None) -> None:
        """madvise the whole tensor's pages, or the given page-aligned spans. No-op without a map."""
        if self._map is None:
            return
        if starts is None:  # the whole tensor: one "row" of all its bytes
            starts, lengths = page_spans(self.offset, self.rows * self.row_nbytes, np.zeros(1, np.int64))
        for start, length in zip(starts.tolist(), lengths.tolist()):
            self._map.madvise(advice, start, length)
