"""FastFlowLM's packed tiles: the codec between them and float32 / bf16, their kernels, and the
repacking of GGML blocks into them (shared/design/formats.md).

A tiled matrix of N × K values is stored as I8 [N/32, K/256, tile bytes]: tile (p, u) holds
rows 32p..32p+31 and columns 256u..256u+255, so the 32 rows of one group are one contiguous run
of (K/256) tiles. Inside a tile, R is the row (0..31), c the column (0..255), kb = c / 32:
- Q8 (8,704 B): bf16 scales at kb·32+R (bytes 0–511); int8 code at 512 + c·32 + R (files of
  FastFlowLM ≥ 1.0.3) or 512 + (R/16)·4096 + c·16 + R%16 (older files); value = scale·q.
- Q4_1 (5,120 B): bf16 d at kb·32+R (0–511), bf16 m (512–1023), nibble at 1024 + c·16 + R/2
  (low nibble: even R); value = q·d + m.
- Q4_K (4,736 B): u8 s at kb·32+R (0–255), u8 m (256–511), nibbles at 512 + c·16 + R/2, bf16
  S[R] (4608–4671), bf16 −M[R] (4672–4735); value = (S·s)·q + M·m.
The float ops are those of the GGML codecs (Q8_0 d·q, Q4_1 q·d + m, Q4_K q·(d·sc) − dmin·m), so
a tile repacked from GGML blocks whose scales are bf16 values decodes to the same bits.
Kernels read the uint8 array they are handed (normally the read-only file map); they never copy it.
"""

from __future__ import annotations

import enum

import numpy as np
from numba import carray, njit, prange

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant.codecs import bf16_to_f32, f32_to_bf16, k_scale_codes
from pagelm.quant.codegen import prefetch, stack_f32, kernel_of
from pagelm.quant.matmul import MAX_GEMV_ROWS, bf16_bits, load_at, u32_as_f32, readonly
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType

ROWS, COLUMNS = 32, 256  # one tile


class TileKind(enum.IntEnum):
    Q8 = 0  # FastFlowLM ≥ 1.0.3 code order
    Q8_V102 = 1  # older files: codes in two halves of 16 rows
    Q4_1 = 2
    Q4_K = 3


TILE_BYTES = {TileKind.Q8: 8704, TileKind.Q8_V102: 8704, TileKind.Q4_1: 5120, TileKind.Q4_K: 4736}
# The GGML block type each kind holds the values of, exactly.
GGML_OF = {TileKind.Q8: GGMLType.Q8_0, TileKind.Q8_V102: GGMLType.Q8_0, TileKind.Q4_1: GGMLType.Q4_1,
           TileKind.Q4_K: GGMLType.Q4_K}


def kind_of_size(tile_bytes: int, q8_v102: bool) -> TileKind | None:
    """The kind a tile of `tile_bytes` is, for a file whose Q8 codes are in 1.0.2's order or not."""
    if tile_bytes == 8704:
        return TileKind.Q8_V102 if q8_v102 else TileKind.Q8
    return {5120: TileKind.Q4_1, 4736: TileKind.Q4_K}.get(tile_bytes)


# --- numpy: whole groups (the unpacked table, and the repacking) ----------------------------


def _bf16_field(raw: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return bf16_to_f32(np.ascontiguousarray(raw[..., lo:hi]).view(np.uint16))


def _nibble_codes(raw: np.ndarray) -> np.ndarray:
    """(G, U, 256, 32) codes from (G, U, 256·16) nibble bytes: byte c·16 + R/2, low nibble even R."""
    b = raw.reshape(raw.shape[0], raw.shape[1], COLUMNS, 16)
    return np.stack((b & 0x0F, b >> 4), axis=-1).reshape(raw.shape[0], raw.shape[1], COLUMNS, ROWS)


def decode_groups(raw: np.ndarray, kind: TileKind) -> np.ndarray:
    """Float32 values (G·32, U·256) of tiles (G, U, tile bytes), vectorised numpy."""
    g, u, size = raw.shape
    if size != TILE_BYTES[kind]:
        raise ModelFormatError(f"{kind.name} tiles are {TILE_BYTES[kind]} bytes, got {size}")
    per_kb = (g, u, 8, 1, ROWS)  # a field at kb·32 + R, broadcast over the 32 columns of kb
    if kind in (TileKind.Q8, TileKind.Q8_V102):
        codes = raw[..., 512:].view(np.int8)
        if kind == TileKind.Q8:
            codes = codes.reshape(g, u, COLUMNS, ROWS)
        else:
            codes = codes.reshape(g, u, 2, COLUMNS, 16).transpose(0, 1, 3, 2, 4).reshape(g, u, COLUMNS, ROWS)
        values = codes.astype(np.float32).reshape(g, u, 8, 32, ROWS)
        values *= _bf16_field(raw, 0, 512).reshape(per_kb)
    elif kind == TileKind.Q4_1:
        values = _nibble_codes(raw[..., 1024:]).astype(np.float32).reshape(g, u, 8, 32, ROWS)
        values *= _bf16_field(raw, 0, 512).reshape(per_kb)
        values += _bf16_field(raw, 512, 1024).reshape(per_kb)
    else:
        scale = _bf16_field(raw, 4608, 4672).reshape(g, u, 1, 1, ROWS)
        minimum = -_bf16_field(raw, 4672, 4736).reshape(g, u, 1, 1, ROWS)
        values = _nibble_codes(raw[..., 512:4608]).astype(np.float32).reshape(g, u, 8, 32, ROWS)
        values *= scale * raw[..., :256].astype(np.float32).reshape(per_kb)
        values += minimum * raw[..., 256:512].astype(np.float32).reshape(per_kb)
    # (g, u, kb, j, R) -> (g, R, u, kb, j)
    return np.ascontiguousarray(values.transpose(0, 4, 1, 2, 3)).reshape(g * ROWS, u * COLUMNS)


def group_steps(raw: np.ndarray, kind: TileKind) -> np.ndarray:
    """The quantization step |value of one code| (G·32, U·8) of each row's 32 columns kb of tiles
    (G, U, tile bytes): half of it bounds how far a decoded value lies from the value it encodes."""
    g, u, _ = raw.shape
    if kind == TileKind.Q4_K:
        steps = _bf16_field(raw, 4608, 4672).reshape(g, u, 1, ROWS) * raw[..., :256].astype(np.float32).reshape(g, u, 8, ROWS)
    else:
        steps = _bf16_field(raw, 0, 512).reshape(g, u, 8, ROWS)
    return np.abs(steps).transpose(0, 3, 1, 2).reshape(g * ROWS, u * 8)


def _exact_bf16(f16: np.ndarray) -> tuple[np.ndarray, int]:
    """bf16 bits of fp16 values, and how many of them bf16 had to round."""
    values = f16.astype(np.float32)
    bits = f32_to_bf16(values)
    return bits, int(np.count_nonzero(bf16_to_f32(bits) != values))


def pack_groups(raw: np.ndarray, ggml_type: int, kind: TileKind) -> tuple[np.ndarray, int]:
    """GGML rows (N, row bytes) of K values repacked as tiles (ceil(N/32), K/256, tile bytes),
    rows repeated from the first to fill the last group (as FastFlowLM pads); also the number of
    fp16 scales bf16 could not hold exactly (rounded: the values then move by that rounding)."""
    t = GGMLType(ggml_type)
    if GGML_OF[kind] != t:
        raise UnsupportedError(f"{kind.name} tiles hold {GGML_OF[kind].name} blocks, not {t.name}")
    n = raw.shape[0]
    per_block, block_bytes = BLOCK_LAYOUT[t]
    k = raw.shape[1] // block_bytes * per_block
    if k % COLUMNS or raw.shape[1] % block_bytes or n == 0:
        raise ModelFormatError(f"tiles need rows of whole 256-value blocks, got {n} rows of {raw.shape[1]} bytes")
    g, u = -(-n // ROWS), k // COLUMNS
    rows = raw[np.arange(g * ROWS) % n]
    out = np.zeros((g, u, TILE_BYTES[kind]), np.uint8)

    def put_per_kb(lo: int, field: np.ndarray) -> None:
        # field (g·32, u·8) per row and kb -> bytes at kb·32 + R
        width = field.dtype.itemsize
        arranged = np.ascontiguousarray(field.reshape(g, ROWS, u, 8).transpose(0, 2, 3, 1))
        out[..., lo : lo + 256 * width] = arranged.reshape(g, u, -1).view(np.uint8)

    def put_nibbles(lo: int, codes: np.ndarray) -> None:
        # codes (g·32, u·256) -> byte c·16 + R/2, low nibble even R
        q = np.ascontiguousarray(codes.reshape(g, ROWS, u, COLUMNS).transpose(0, 2, 3, 1)).reshape(g, u, COLUMNS, 16, 2)
        out[..., lo : lo + 4096] = (q[..., 0] | (q[..., 1] << 4)).reshape(g, u, 4096)

    inexact = 0
    if t == GGMLType.Q8_0:
        blocks = rows.reshape(g * ROWS, -1, 34)
        scales, inexact = _exact_bf16(blocks[..., :2].copy().view(np.float16)[..., 0])
        put_per_kb(0, scales)
        codes = blocks[..., 2:].reshape(g, ROWS, u, COLUMNS)
        if kind == TileKind.Q8:
            out[..., 512:] = codes.transpose(0, 2, 3, 1).reshape(g, u, -1)
        else:
            halves = codes.reshape(g, 2, 16, u, COLUMNS).transpose(0, 3, 1, 4, 2)
            out[..., 512:] = halves.reshape(g, u, -1)
    elif t == GGMLType.Q4_1:
        blocks = rows.reshape(g * ROWS, -1, 20)
        d, inexact_d = _exact_bf16(blocks[..., 0:2].copy().view(np.float16)[..., 0])
        m, inexact_m = _exact_bf16(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        inexact = inexact_d + inexact_m
        put_per_kb(0, d)
        put_per_kb(512, m)
        qs = blocks[..., 4:]
        put_nibbles(1024, np.concatenate((qs & 0x0F, qs >> 4), axis=-1))
    else:
        blocks = rows.reshape(-1, 144)
        sm = k_scale_codes(blocks).reshape(g * ROWS, u, 2, 8)
        put_per_kb(0, np.ascontiguousarray(sm[:, :, 0]))
        put_per_kb(256, np.ascontiguousarray(sm[:, :, 1]))
        qs = blocks[:, 16:].reshape(g * ROWS, u, 4, 1, 32)
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=3)  # sub-block 2j: low nibbles, 2j + 1: high
        put_nibbles(512, codes.reshape(g * ROWS, u * COLUMNS))
        d_dmin = blocks[:, :4].copy().view(np.float16).reshape(g, ROWS, u, 2)
        d, inexact_d = _exact_bf16(d_dmin[..., 0])
        dmin, inexact_m = _exact_bf16(d_dmin[..., 1])
        inexact = inexact_d + inexact_m
        out[..., 4608:4672] = np.ascontiguousarray(d.transpose(0, 2, 1)).view(np.uint8)
        out[..., 4672:4736] = np.ascontiguousarray(dmin.transpose(0, 2, 1)).view(np.uint8)  # −M is dmin
    return out, inexact


# --- numba kernels ---------------------------------------------------------------------


@njit(inline="always")
def _bf16_at(data, at):
    return u32_as_f32(np.uint32(load_at(data, at, np.uint16)) << np.uint32(16))


@njit(inline="always")
def _code(kind, data, t, c, r):
    """The integer code of row r, column c of the tile at byte t."""
    if kind == 0:
        return np.float32(load_at(data, t + 512 + c * 32 + r, np.int8))
    if kind == 1:
        return np.float32(load_at(data, t + 512 + (r // 16) * 4096 + c * 16 + r % 16, np.int8))
    at = t + (1024 if kind == 2 else 512) + c * 16 + r // 2
    return np.float32((load_at(data, at, np.uint8) >> np.uint8(4 * (r & 1))) & np.uint8(15))


@njit(inline="always")
def _scale_offset(kind, data, t, kb, r):
    """(scale, offset) of row r's 32 columns kb·32.. in the tile at byte t: value = q·scale + offset."""
    if kind <= 1:
        return _bf16_at(data, t + 2 * (kb * 32 + r)), np.float32(0)
    if kind == 2:
        return _bf16_at(data, t + 2 * (kb * 32 + r)), _bf16_at(data, t + 512 + 2 * (kb * 32 + r))
    scale = _bf16_at(data, t + 4608 + 2 * r) * np.float32(load_at(data, t + kb * 32 + r, np.uint8))
    minimum = -_bf16_at(data, t + 4672 + 2 * r) * np.float32(load_at(data, t + 256 + kb * 32 + r, np.uint8))
    return scale, minimum


def _rows_kernel(kind: int, bf16: bool):
    @kernel_of(f"{TileKind(kind).name}_{'bf16' if bf16 else 'f32'}", parallel=True)
    def rows(data, base, col_tiles, tile_bytes, row_ids, out):
        for i in prange(row_ids.shape[0]):
            r = row_ids[i] % ROWS
            group = base + (row_ids[i] // ROWS) * col_tiles * tile_bytes
            for u in range(col_tiles):
                t = group + u * tile_bytes
                for kb in range(8):
                    scale, offset = _scale_offset(kind, data, t, kb, r)
                    for j in range(32):
                        c = kb * 32 + j
                        value = _code(kind, data, t, c, r) * scale
                        if kind >= 2:  # Q8 adds nothing: a zero code keeps its -0.0, as numpy's decode does
                            value += offset
                        if bf16:
                            out[i, u * COLUMNS + c] = bf16_bits(value)
                        else:
                            out[i, u * COLUMNS + c] = value

    return rows


@njit(inline="always")
def _tile_gemv(kind, data, t, x, xo, acc, w_scale, w_offset):
    """acc[r] += Σ_c w(r, c) · x[xo + c] over the tile at byte t, w exactly decoded (fp32)."""
    for kb in range(8):
        for r in range(ROWS):
            w_scale[r], w_offset[r] = _scale_offset(kind, data, t, kb, r)
        for j in range(32):
            c = kb * 32 + j
            xv = x[xo + c]
            if kind == 0:
                at = t + 512 + c * 32
                for r in range(ROWS):
                    acc[r] += np.float32(load_at(data, at + r, np.int8)) * w_scale[r] * xv
            elif kind == 1:
                at = t + 512 + c * 16
                for r in range(16):
                    acc[r] += np.float32(load_at(data, at + r, np.int8)) * w_scale[r] * xv
                for r in range(16):
                    acc[16 + r] += np.float32(load_at(data, at + 4096 + r, np.int8)) * w_scale[16 + r] * xv
            else:
                at = t + (1024 if kind == 2 else 512) + c * 16
                for h in range(16):
                    byte = load_at(data, at + h, np.uint8)
                    lo, hi = 2 * h, 2 * h + 1
                    acc[lo] += (np.float32(byte & np.uint8(15)) * w_scale[lo] + w_offset[lo]) * xv
                    acc[hi] += (np.float32(byte >> np.uint8(4)) * w_scale[hi] + w_offset[hi]) * xv


def _matmul_kernel(kind: int):
    @kernel_of(TileKind(kind).name, parallel=True, fastmath={"contract"})
    def matmul(data, base, col_tiles, tile_bytes, groups, x, out):
        for p in prange(groups):
            acc = carray(stack_f32(ROWS), ROWS)
            w_scale = carray(stack_f32(ROWS), ROWS)
            w_offset = carray(stack_f32(ROWS), ROWS)
            group = base + p * col_tiles * tile_bytes
            for i in range(x.shape[0]):
                xi = x[i]
                for r in range(ROWS):
                    acc[r] = 0
                for u in range(col_tiles):
                    t = group + u * tile_bytes
                    prefetch(data, t + tile_bytes)
                    _tile_gemv(kind, data, t, xi, u * COLUMNS, acc, w_scale, w_offset)
                for r in range(ROWS):
                    out[i, p * ROWS + r] = acc[r]

    return matmul


_KERNELS = {kind: (_matmul_kernel(int(kind)), _rows_kernel(int(kind), False), _rows_kernel(int(kind), True))
            for kind in TileKind}


# --- public API ---------------------------------------------------------------------


def check_tiles(data: np.ndarray, kind: TileKind, base: int, groups: int, col_tiles: int) -> None:
    """Validates, once at load, what the kernels then trust: the tiles lie inside `data`."""
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1):
        raise ValueError("data must be a 1-D uint8 array")
    end = base + groups * col_tiles * TILE_BYTES[kind]
    if base < 0 or groups < 1 or col_tiles < 1 or end > data.size:
        raise ModelFormatError(f"{kind.name} tiles [{groups}, {col_tiles}] at byte offset {base} lie outside "
                               f"the {data.size} bytes of data")


def tile_matmul(data: np.ndarray, kind: TileKind, base: int, groups: int, col_tiles: int,
                x: np.ndarray, out: np.ndarray) -> None:
    """out (n, groups·32) = x (n, col_tiles·256) @ W.T for the tiled W at byte `base` of `data`
    (checked by check_tiles); 1 <= n <= MAX_GEMV_ROWS, fp32 accumulation of the decoded weights.
    Groups of 32 rows run in parallel on numba's threads."""
    if not (x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous and 1 <= x.shape[0] <= MAX_GEMV_ROWS
            and x.shape[1] == col_tiles * COLUMNS):
        raise ValueError(f"x must be C-contiguous float32 (n, {col_tiles * COLUMNS}), 1 <= n <= {MAX_GEMV_ROWS}")
    if not (out.dtype == np.float32 and out.shape == (x.shape[0], groups * ROWS) and out.flags.c_contiguous
            and out.flags.writeable):
        raise ValueError(f"out must be writeable C-contiguous float32 ({x.shape[0]}, {groups * ROWS})")
    _KERNELS[kind][0](readonly(data), base, col_tiles, TILE_BYTES[kind], groups, readonly(x), out)


def tile_dequantize(data: np.ndarray, kind: TileKind, base: int, groups: int, col_tiles: int,
              row_ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = row row_ids[i] of the tiled W: float32 values, or (uint16 out) their bf16 bits
    rounded to nearest even. Rows must be below groups·32. Parallel over rows."""
    row_ids = np.ascontiguousarray(row_ids, np.int64)
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= groups * ROWS):
        raise ValueError(f"row ids must lie in 0..{groups * ROWS - 1}")
    if not (out.dtype in (np.float32, np.uint16) and out.shape == (row_ids.size, col_tiles * COLUMNS)
            and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"out must be writeable C-contiguous float32 or uint16 ({row_ids.size}, {col_tiles * COLUMNS})")
    kernel = _KERNELS[kind][2 if out.dtype == np.uint16 else 1]
    kernel(readonly(data), base, col_tiles, TILE_BYTES[kind], readonly(row_ids), out)


def warmup(kinds, dequantize_to=(np.float32, np.uint16)) -> None:
    """Compiles (or loads from numba's cache) the kernels of `kinds` on one tile, its dequantizer to the
    dtypes `dequantize_to` (float32, uint16: bf16 bits)."""
    for kind in kinds:
        data = np.zeros(TILE_BYTES[kind], np.uint8)
        tile_matmul(data, kind, 0, 1, 1, np.zeros((1, COLUMNS), np.float32), np.empty((1, ROWS), np.float32))
        for dtype in dequantize_to:
            tile_dequantize(data, kind, 0, 1, 1, np.zeros(1, np.int64), np.empty((1, COLUMNS), dtype))

