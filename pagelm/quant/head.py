"""The output head's kernels over GGML block bytes: logits (GEMV: matmul's kernels over the table
for Q8_0 and Q6_K), and the table's rows gathered to bf16 (a tied head is the token table).

Kernels read the uint8 (rows, row_nbytes) views they are handed; they never open files, copy or write the table.
"""

import numpy as np
from numba import njit

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant.codecs import DECODABLE, decode_bf16, decode_f32
from pagelm.quant.codegen import F16_TO_F32, f32_bits, wide_vectors
from pagelm.quant.matmul import MAX_GEMV_ROWS, TABLE_TYPES, readonly, table_matmul
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type

_T = GGMLType

# The fallback head decodes about this many values at a time.
FALLBACK_CHUNK = 1 << 16

@njit(inline="always")
def _bf16(f):
    """bf16 bits of float32 `f`: round to nearest even; NaN keeps sign and upper bits, quieted."""
    u = f32_bits(f)
    if f != f:
        return (u >> 16) | 0x0040
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


@njit(inline="always")
def _f16(f16, row, o):
    """The little-endian fp16 at row[o : o + 2], as float32."""
    return f16[row[o] | np.uint16(row[o + 1]) << 8]


@njit(inline="always")
def _q6(lo, hi, top):
    """The four 6-bit values (minus 32) held by low bytes ql[l], ql[l+32] and high bits qh[l].

    Truncating to int8 (exact: -32..31) lets LLVM vectorize the bit twiddling in bytes.
    """
    return (
        np.int8((lo & 15 | (top & 3) << 4) - 32),
        np.int8((hi & 15 | (top >> 2 & 3) << 4) - 32),
        np.int8((lo >> 4 | (top >> 4 & 3) << 4) - 32),
        np.int8((hi >> 4 | (top >> 6) << 4) - 32),
    )


# Hidden states one head_logits call multiplies at once: the head runs matmul's GEMV kernels for
# Q8_0 and Q6_K tables.
MAX_HEAD_ROWS = MAX_GEMV_ROWS


# --- gather: out[i] = bf16(dequant(table[ids[i]])), bit-identical to decode_bf16 -----


@njit(cache=True)
def _first_bad_id(ids, rows):
    for i in range(len(ids)):
        if not 0 <= ids[i] < rows:
            return i
    return -1


@njit(cache=True)
def _gather_q8_0(table, ids, f16, out):
    bad = _first_bad_id(ids, table.shape[0])
    if bad >= 0:
        return bad
    wide_vectors()
    for i in range(len(ids)):
        row = table[ids[i]]
        for b in range(len(row) // 34):
            o = b * 34
            d = _f16(f16, row, o)
            for j in range(32):
                out[i, b * 32 + j] = _bf16(np.float32(np.int8(row[o + 2 + j])) * d)
    return -1


@njit(cache=True)
def _gather_q6_k(table, ids, f16, out):
    bad = _first_bad_id(ids, table.shape[0])
    if bad >= 0:
        return bad
    wide_vectors()
    for i in range(len(ids)):
        row = table[ids[i]]
        for b in range(len(row) // 210):
            o = b * 210
            d = _f16(f16, row, o + 208)
            for h in range(2):
                ql, qh, sc, yo = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h, 256 * b + 128 * h
                for p in range(2):
                    s0 = d * np.float32(np.int8(row[sc + p]))
                    s1 = d * np.float32(np.int8(row[sc + 2 + p]))
                    s2 = d * np.float32(np.int8(row[sc + 4 + p]))
                    s3 = d * np.float32(np.int8(row[sc + 6 + p]))
                    for j in range(16):
                        l = 16 * p + j
                        q0, q1, q2, q3 = _q6(row[ql + l], row[ql + 32 + l], row[qh + l])
                        out[i, yo + l] = _bf16(np.float32(q0) * s0)
                        out[i, yo + 32 + l] = _bf16(np.float32(q1) * s1)
                        out[i, yo + 64 + l] = _bf16(np.float32(q2) * s2)
                        out[i, yo + 96 + l] = _bf16(np.float32(q3) * s3)
    return -1


_GATHER = {_T.Q8_0: _gather_q8_0, _T.Q6_K: _gather_q6_k}


# --- public API ---------------------------------------------------------------------


# Kernels are compiled for one set of argument types: a read-only table (as mapped) and
# writeable small inputs (x, ids), which are copied in the rare case they are read-only.


def _writeable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


def check_table(table: np.ndarray, ggml_type: int) -> tuple[GGMLType, int]:
    """The type and the values per row of a (rows, row_nbytes) table."""
    t = as_ggml_type(ggml_type)
    if t not in DECODABLE:
        raise UnsupportedError(f"no kernel or decoder for GGML type {t.name}")
    if not isinstance(table, np.ndarray) or table.dtype != np.uint8 or table.ndim != 2 or not table.flags.c_contiguous:
        raise ValueError(
            f"table must be a C-contiguous 2-D uint8 array (rows, row_nbytes), got "
            f"{getattr(table, 'dtype', type(table).__name__)} with shape {getattr(table, 'shape', None)}"
        )
    block_values, block_bytes = BLOCK_LAYOUT[t]
    if table.shape[1] % block_bytes:
        raise ModelFormatError(
            f"{t.name}: a row of {table.shape[1]} bytes is not a whole number of {block_bytes}-byte blocks"
        )
    return t, table.shape[1] // block_bytes * block_values


def _check_out(out: np.ndarray | None, shape: tuple, dtype) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous {np.dtype(dtype).name} array of shape {shape}, "
            f"got {getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', None)}"
        )
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    return out


def head_logits(table: np.ndarray, ggml_type: int, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """logits[v] = dequant(table[v]) . x in float32 for a (vocab, row_nbytes) table and x (dim,);
    for x (n, dim), n <= MAX_HEAD_ROWS hidden states, logits (n, vocab) whose row i is bit for bit
    the logits of x[i] alone, each table row read once for all of them.

    Q8_0 and Q6_K run a kernel over the bytes on numba's threads (numba.set_num_threads); other
    decodable types decode chunks of rows and multiply them with numpy.
    """
    t, dim = check_table(table, ggml_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1:] != (dim,) or x.ndim > 2 or (x.ndim == 2 and not 1 <= len(x) <= MAX_HEAD_ROWS):
        raise ValueError(f"x must have shape ({dim},) or (n, {dim}) with 1 <= n <= {MAX_HEAD_ROWS} for this table, "
                         f"got {x.shape}")
    out = _check_out(out, x.shape[:-1] + (table.shape[0],), np.float32)
    xs, outs = (x, out) if x.ndim == 2 else (x[None], out[None])
    if t in TABLE_TYPES:
        table_matmul(table, t, _writeable(xs), outs)
        return out
    step = max(1, FALLBACK_CHUNK // max(dim, 1))
    scratch = np.empty((min(step, len(table)), dim), np.float32)
    for lo in range(0, len(table), step):
        part = table[lo : lo + step]
        s = scratch[: len(part)]
        decode_f32(part, t, out=s)
        for i in range(len(xs)):
            np.matmul(s, xs[i], out=outs[i, lo : lo + step])
    return out


def gather_rows_bf16(
    table: np.ndarray, ggml_type: int, ids: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """bf16 bits (n, dim) of rows `ids` of a table: the same bits as decode_bf16(table[ids]).

    Raises IndexError, before reading any row, if an id is outside [0, rows).
    """
    t, dim = check_table(table, ggml_type)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
    out = _check_out(out, (len(ids), dim), np.uint16)
    kernel = _GATHER.get(t)
    if kernel is not None:
        bad = kernel(readonly(table), _writeable(ids), F16_TO_F32, out)
    else:
        bad = _first_bad_id(_writeable(ids), len(table))
        if bad < 0:
            decode_bf16(table[ids], t, out=out)
    if bad >= 0:
        raise IndexError(f"ids[{bad}] = {ids[bad]} is outside the table's {len(table)} rows")
    return out


def warmup(types=TABLE_TYPES, parts=("logits", "gather")) -> None:
    """Compiles the kernels of the table types among `types` (default: both), or loads them from numba's
    cache, so that no request waits for it: of `parts`, the logits' (matmul's GEMVs of the type) and the
    rows' gather."""
    ids = np.zeros(1, np.int64)
    for t in (_T.Q8_0, _T.Q6_K):
        if t not in types:
            continue
        values, nbytes = BLOCK_LAYOUT[t]
        table = np.zeros((1, nbytes), np.uint8)
        if "logits" in parts:
            head_logits(table, t, np.zeros(values, np.float32))
            head_logits(table, t, np.zeros((2, values), np.float32))
        if "gather" in parts:
            gather_rows_bf16(table, t, ids)
    _first_bad_id(ids, 1)  # as called by the numpy gather path
