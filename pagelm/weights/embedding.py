"""The token embedding (dense table or rows on demand) and the output head, served from tables in place.

Owns the two embedding modes and the head's logits; never parses files (it takes an open
checkpoint; `weights.mapped` reads its table, GGML rows or FastFlowLM tiles) and never does layer math.
"""

from __future__ import annotations

import mmap
from typing import Callable, Literal

import numpy as np

from pagelm.errors import PagelmError
from pagelm.quant.int8dot import INT8_TYPES, Int8Rows, bound_table_matmul_int8
from pagelm.quant.matmul import MAX_GEMV_ROWS
from pagelm.weights.mapped import DECODE_CHUNK_ROWS, MappedTensor, table_tensor, tiled_matrices

EmbeddingMode = Literal["mapped", "dense"]
EMBEDDING_MODES: tuple[str, ...] = ("mapped", "dense")
RowFormat = Literal["bf16", "f32"]
ROW_FORMATS: tuple[str, ...] = ("bf16", "f32")
_ROW_DTYPES = {"bf16": np.uint16, "f32": np.float32}
TOKEN_EMBEDDING = "token_embd.weight"
OUTPUT_HEAD = "output.weight"


class TokenEmbedding:
    """Rows of the token embedding, shape (n, dim): bf16 bit patterns (uint16) by default, or
    float32 for float32 compute. Both modes give the same bits for the same row format."""

    mode: EmbeddingMode

    def __init__(self, tensor, rows: RowFormat):
        if rows not in ROW_FORMATS:
            raise PagelmError(f"row format must be one of {', '.join(ROW_FORMATS)}, got {rows!r}")
        self.tensor = tensor
        self.rows = rows
        self.vocab_size = tensor.rows
        self.dim = tensor.row_values

    def lookup(self, token_ids) -> np.ndarray:
        raise NotImplementedError

    def prefetch(self, token_ids) -> None:
        """Hint the OS about the rows a prompt will read. Only meaningful for mapped rows."""

    def _checked_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim == 0:
            ids = ids.reshape(1)
        if ids.size == 0:
            return np.empty(0, np.int64)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise PagelmError(f"token ids must be a 1-D sequence of integers, got {ids.dtype} {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise PagelmError(f"token id {int(bad)} out of range for vocabulary of {self.vocab_size}")
        return ids.astype(np.int64, copy=False)


class DenseTable(TokenEmbedding):
    """The old way: the whole table unpacked (to bf16) in anonymous memory at load."""

    mode = "dense"

    def __init__(self, tensor, rows: RowFormat = "bf16", progress: Callable[[int], None] | None = None):
        super().__init__(tensor, rows)
        self.table = np.empty((self.vocab_size, self.dim), _ROW_DTYPES[rows])
        for lo in range(0, self.vocab_size, DECODE_CHUNK_ROWS):
            hi = min(lo + DECODE_CHUNK_ROWS, self.vocab_size)
            tensor.decode(lo, hi, self.table[lo:hi])
            if progress:
                progress(hi - lo)

    def lookup(self, token_ids) -> np.ndarray:
        return self.table[self._checked_ids(token_ids)]


class MappedRows(TokenEmbedding):
    """pagelm's way: rows dequantized on demand from the read-only map, bit-identical to dense."""

    mode = "mapped"

    def __init__(self, tensor, rows: RowFormat = "bf16"):
        super().__init__(tensor, rows)
        # one row per token, scattered across the table: read-ahead would only waste page cache
        tensor.advise(mmap.MADV_RANDOM)

    def lookup(self, token_ids) -> np.ndarray:
        return self.tensor.lookup(self._checked_ids(token_ids), _ROW_DTYPES[self.rows])

    def prefetch(self, token_ids) -> None:
        self.tensor.prefetch(self._checked_ids(token_ids))


def load_token_embedding(
    model,
    embedding: EmbeddingMode = "mapped",
    rows: RowFormat = "bf16",
    progress: Callable[[int], None] | None = None,
) -> TokenEmbedding:
    """The model's token embedding in the chosen mode and row format. `progress(rows)` reports
    dense unpacking."""
    if embedding not in EMBEDDING_MODES:
        raise PagelmError(f"embedding must be one of {', '.join(EMBEDDING_MODES)}, got {embedding!r}")
    tensor = table_tensor(model, TOKEN_EMBEDDING)
    if embedding == "dense":
        return DenseTable(tensor, rows, progress)
    return MappedRows(tensor, rows)


class OutputHead:
    """Logits computed straight from the mapped output table (tied token_embd or output.weight):
    fp32 accumulation over the quantized bytes, no vocab × dim float copy anywhere. With `int8`
    (weights "mapped-int8"), a GGML table of a quantized type multiplies the hidden state quantized
    to int8 (quant.int8dot)."""

    def __init__(self, tensor, int8: bool = False):
        self.tensor = tensor
        self.vocab_size = tensor.rows
        self.dim = tensor.row_values
        self._int8 = None
        if int8 and isinstance(tensor, MappedTensor) and tensor.ggml_type in INT8_TYPES:
            self._int8 = bound_table_matmul_int8(tensor.raw, tensor.ggml_type)
        # every token reads the whole table: normal readahead (a tied table got MADV_RANDOM from
        # MappedRows, which would bring it back from disk 4 KiB per fault after eviction), and
        # all of it asked for now, in the background
        tensor.advise(mmap.MADV_NORMAL)
        tensor.advise(mmap.MADV_WILLNEED)

    def logits(self, hidden: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Logits (vocab,) of a hidden state (dim,), or (n, vocab) of n states (n, dim), row i
        bit for bit the logits of hidden[i] alone."""
        if self._int8 is None:
            return self.tensor.logits(hidden, out)
        hidden = np.ascontiguousarray(hidden, np.float32)
        if hidden.shape[-1:] != (self.dim,) or hidden.ndim > 2:
            raise ValueError(f"hidden must have shape ({self.dim},) or (n, {self.dim}), got {hidden.shape}")
        if out is None:
            out = np.empty(hidden.shape[:-1] + (self.vocab_size,), np.float32)
        rows, outs = hidden.reshape(-1, self.dim), out.reshape(-1, self.vocab_size)
        for lo in range(0, len(rows), MAX_GEMV_ROWS):  # each state quantized on its own, as alone; the table read once
            self._int8(Int8Rows(rows[lo : lo + MAX_GEMV_ROWS]), outs[lo : lo + MAX_GEMV_ROWS], 0)
        return out


def load_output_head(model, int8: bool = False) -> OutputHead:
    """The untied `output.weight` when the file has one, else the tied token embedding table."""
    untied = OUTPUT_HEAD in model.tensors or OUTPUT_HEAD in tiled_matrices(model)
    return OutputHead(table_tensor(model, OUTPUT_HEAD if untied else TOKEN_EMBEDDING), int8)
