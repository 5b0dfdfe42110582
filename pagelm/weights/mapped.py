"""Tables viewed in place in the read-only map of their file, and the page spans of their rows.

Owns the two ways a (vocab × dim) table can be stored, behind one interface the embedding, the
output head and `verify` use: `MappedTensor` (GGML rows, one after another) and `TiledTensor`
(FastFlowLM tiles, 32 rows interleaved per group). Never copies a table, never does model math.
"""

from __future__ import annotations

import mmap

import numpy as np

from pagelm.errors import PagelmError, UnsupportedError
from pagelm.quant import DECODABLE, decode_bf16, decode_f32, f32_to_bf16
from pagelm.quant.head import gather_rows_bf16, head_logits
from pagelm.quant.tiles import ROWS, decode_groups, tile_matmul, tile_dequantize

# Bounds the fp32 temporaries of a decode (rows × dim × 4 bytes) while keeping numpy vectorised.
DECODE_CHUNK_ROWS = 1024


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


class ExpertPages:
    """The page spans of each expert of a layer's mixture in its file's map (its rows of every 3-D expert
    tensor of the layer), hinted (MADV_WILLNEED) before a prefill reads them: the routed experts' pages
    read at once, not faulted in one after another as each expert's product reaches them."""

    def __init__(self, file_map: mmap.mmap, spans: list[tuple[np.ndarray, np.ndarray]]):
        self._map, self.spans = file_map, spans  # spans[e]: expert e's (starts, lengths)

    def prefetch(self, experts) -> None:
        for e in experts:
            for start, length in zip(*(a.tolist() for a in self.spans[e])):
                self._map.madvise(mmap.MADV_WILLNEED, start, length)


class _Table:
    """What both layouts share: the name, the size, the map and its hints."""

    name: str
    file_name: str
    type_name: str
    rows: int
    row_values: int
    raw: np.ndarray  # the table's bytes in the map
    offset: int  # of the table in its file
    _map: mmap.mmap | None

    def advise(self, advice: int, starts=None, lengths=None) -> None:
        """madvise the whole table's pages, or the given page-aligned spans. No-op without a map."""
        if self._map is None:
            return
        if starts is None:  # the whole table: one "row" of all its bytes
            starts, lengths = page_spans(self.offset, self.raw.size, np.zeros(1, np.int64))
        for start, length in zip(starts.tolist(), lengths.tolist()):
            self._map.madvise(advice, start, length)

    def prefetch(self, ids: np.ndarray) -> None:
        """Ask the OS for the pages that rows `ids` live on."""
        self.advise(mmap.MADV_WILLNEED, *self.row_spans(ids))

    def row_spans(self, ids: np.ndarray):
        raise NotImplementedError

    def lookup(self, ids: np.ndarray, dtype) -> np.ndarray:
        """Rows `ids` (checked by the caller) as bf16 bits (uint16) or float32."""
        raise NotImplementedError

    def decode(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows lo:hi into `out` (bf16 bits or float32), the whole-table way (the dense table's)."""
        raise NotImplementedError

    def logits(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """table · x (dim,) in float32, from the bytes in place; for x (n, dim), (n, vocab) whose
        row i is bit for bit the logits of x[i] alone."""
        raise NotImplementedError


class MappedTensor(_Table):
    """A 2-D GGML tensor (rows × row bytes) viewed in place in the read-only map of its file."""

    def __init__(self, model, name: str):
        if name not in model.tensors:
            raise PagelmError(f"{model.name}: tensor '{name}' not found")
        info = model.tensors[name]
        self.name, self.file_name = name, model.name
        self.ggml_type = info.ggml_type
        self.type_name = info.ggml_type.name
        if self.ggml_type not in DECODABLE:
            raise UnsupportedError(f"{model.name}: tensor '{name}' has type {self.type_name}, which pagelm cannot "
                                   f"decode (supported: {', '.join(sorted(t.name for t in DECODABLE))})")
        self.offset = info.offset
        self.row_values = info.dims[0]
        self.row_nbytes = info.row_nbytes
        self.rows = info.n_elements // info.dims[0]
        self.raw = model.tensor_data(name).reshape(self.rows, self.row_nbytes)
        self._map = model.tensor_buffer(name)[1]

    def row_spans(self, ids):
        return page_spans(self.offset, self.row_nbytes, ids)

    def lookup(self, ids, dtype):
        if dtype == np.uint16:
            return gather_rows_bf16(self.raw, self.ggml_type, ids)
        out = np.empty((ids.size, self.row_values), np.float32)
        for lo in range(0, ids.size, DECODE_CHUNK_ROWS):
            chunk = ids[lo : lo + DECODE_CHUNK_ROWS]
            decode_f32(self.raw[chunk], self.ggml_type, out=out[lo : lo + chunk.size])
        return out

    def decode(self, lo, hi, out):
        (decode_bf16 if out.dtype == np.uint16 else decode_f32)(self.raw[lo:hi], self.ggml_type, out=out)

    def logits(self, x, out=None):
        return head_logits(self.raw, self.ggml_type, np.ascontiguousarray(x, np.float32), out)


class TiledTensor(_Table):
    """A FastFlowLM tiled table (`weights.flm.TiledMatrix`): row r lives in group r / 32, spread
    through that group's tiles, so a row's pages are its whole group's."""

    def __init__(self, model, name: str):
        matrix = model.tiles.get(name)
        if matrix is None:
            raise PagelmError(f"{model.name}: tiled tensor '{name}' not found")
        self.matrix = matrix
        self.name, self.file_name = name, model.name
        self.type_name = f"FastFlowLM {matrix.kind.name} tiles"
        self.offset, self.rows, self.row_values = matrix.offset, matrix.rows, matrix.columns
        self.raw = matrix.data[matrix.offset : matrix.offset + matrix.nbytes].reshape(matrix.groups, matrix.col_tiles, -1)
        self._map = matrix.map

    def row_spans(self, ids):
        return page_spans(self.offset, self.raw[0].size, np.asarray(ids, np.int64) // ROWS)

    def lookup(self, ids, dtype):
        m = self.matrix
        out = np.empty((ids.size, self.row_values), dtype)
        tile_dequantize(m.data, m.kind, m.offset, m.groups, m.col_tiles, ids, out)
        return out

    def decode(self, lo, hi, out):
        first, last = lo // ROWS, -(-hi // ROWS)
        values = decode_groups(self.raw[first:last], self.matrix.kind)[lo - first * ROWS : hi - first * ROWS]
        if out.dtype == np.uint16:
            f32_to_bf16(values, out=out)
        else:
            out[...] = values

    def logits(self, x, out=None):
        m = self.matrix
        if np.ndim(x) == 2:  # several states: each as alone
            out = np.empty((len(x), self.rows), np.float32) if out is None else out
            for row, logits in zip(x, out):
                self.logits(row, logits)
            return out
        if out is None:
            out = np.empty(self.rows, np.float32)
        # the kernel writes whole groups: padded ones (rows not a multiple of 32), or an `out` it
        # cannot write in place, go through a buffer
        direct = self.rows == m.groups * ROWS and out.dtype == np.float32 and out.shape == (self.rows,) \
            and out.flags.c_contiguous and out.flags.writeable
        full = out if direct else np.empty(m.groups * ROWS, np.float32)
        x = np.ascontiguousarray(x, np.float32)[None]
        tile_matmul(m.data, m.kind, m.offset, m.groups, m.col_tiles, x, full.reshape(1, -1))
        if full is not out:
            out[...] = full[: self.rows]
        return out


def tiled_matrices(model) -> dict:
    """GGUF name -> TiledMatrix of a checkpoint's tiled matrices (only FastFlowLM directories have any)."""
    return getattr(model, "tiles", {})


def table_tensor(model, name: str) -> _Table:
    """Tensor `name` of a checkpoint viewed in place, whichever way it is stored."""
    if name in tiled_matrices(model):
        return TiledTensor(model, name)
    return MappedTensor(model, name)
