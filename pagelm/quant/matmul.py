"""Numba linear layers over GGML block bytes in place: x @ W.T and W -> float32 / bf16, rows addressed by byte offset.

Kernels read the uint8 array they are handed (normally the read-only file map); they never open files, copy or write it.
"""

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.runtime.threads import kernel_threads
from pagelm.quant.blockir import (
    acc_store,
    acc_vectors,
    acc_zero,
    fma_rows,
    k4_scales,
    q4_floats,
    q4k_floats,
    q5_floats,
    q5_values,
    q6k_scales16,
    q6k_values,
    q6k_floats,
    stack_bytes,
    values32,
)
from pagelm.quant.codecs import DECODABLE, MXFP4_VALUES
from pagelm.quant.codegen import (
    F16_TO_F32,
    f32_bits,
    keep_loops,
    opaque,
    prefetch,
    stack_f32,
    wide_vectors,
    kernel_of,
)
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type

MAX_GEMV_ROWS = 16  # activation rows one call multiplies

_T = GGMLType
# Kernel kinds: compile-time constants inside the kernels (LLVM folds the chains of `kind ==`).
_F32, _F16, _BF16 = int(_T.F32), int(_T.F16), int(_T.BF16)
_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1 = int(_T.Q8_0), int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q5_1)
_Q4_K, _Q5_K, _Q6_K = int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)
_MXFP4 = int(_T.MXFP4)

# Hint the rows about this many bytes ahead of the one being read (about 7 rows of 1,024 Q8_0 values):
# the hardware prefetcher stops at each 4 KiB page, hints do not. The K-quants, whose GEMVs spend the most
# instructions per byte, hint twice as far: over every matrix of the q4_k_m mix, cold, most of their
# GEMVs took 0.90-0.95 of the time with 16 KiB, where the Q8_0 file's took 1.05-1.08 (an AVX-512 Xeon,
# 2 threads). The int8 GEMVs and the dequantizers follow, unmeasured apart (their passes level).
_AHEAD = 8192
_AHEAD_K = 16384


def _compiles_avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512. As numba does, the host's features unless
    NUMBA_CPU_FEATURES names others (NUMBA_CPU_NAME alone changes the tuning, not the instructions):
    tests/quant/test_avx2_kernels.py names Haswell's to run the AVX2 code on an AVX-512 host."""
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


# Whether the kernels compile for AVX-512: they then pick 4- and 5-bit values from tables (vpermps,
# vpermi2ps), and a pass over several rows of x goes over two rows of W at once (blockir.fma_rows'
# pair), so that each vector of x loaded serves two FMAs: 6 rows of x keep 24 accumulators, 2 vectors
# of 16 lanes a row (a 256-value block runs through them 8 times, 32 values a time). AVX2's 16
# registers hold no pair beside the block's values: one row of W, 2 rows of x.
AVX512 = _compiles_avx512()


# --- loads --------------------------------------------------------------------------


@intrinsic
def load_at(typingctx, data, offset, ty):
    """The `ty` value at byte `offset` of uint8 array `data`, unaligned and without index wraparound."""
    rtype = ty.instance_type

    def codegen(context, builder, signature, args):
        base = context.make_array(data)(context, builder, args[0]).data
        ptr = builder.gep(builder.bitcast(base, ir.IntType(8).as_pointer()), [args[1]])
        return builder.load(builder.bitcast(ptr, context.get_value_type(rtype).as_pointer()), align=1)

    return rtype(data, offset, ty), codegen


@intrinsic
def _shr8(typingctx, byte, shift):
    """uint8 byte >> shift (< 8) as an 8-bit op: numba widens shifts to 64 bits, and LLVM then
    vectorizes a shift whose amount varies in 64-bit lanes."""

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        return builder.lshr(builder.trunc(args[0], i8), builder.trunc(args[1], i8))

    return types.uint8(types.uint8, types.intp), codegen


@intrinsic
def bf16_bits(typingctx, value):
    """head._bf16 in 32-bit integer ops (numba's are 64-bit, which vectorize at half the width):
    round to nearest even; a NaN keeps its sign and upper bits, quieted."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        hi = builder.lshr(u, i32(16))
        rounded = builder.lshr(builder.add(builder.add(u, i32(0x7FFF)), builder.and_(hi, i32(1))), i32(16))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        bits = builder.select(nan, builder.or_(hi, i32(0x40)), rounded)
        return builder.trunc(bits, ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def u32_as_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(inline="always")
def _u8(data, at):
    return load_at(data, at, np.uint8)


@njit(inline="always")
def fp16_at(f16, data, at):
    """The fp16 at data[at : at + 2] as float32, through the table (numpy's exact conversion)."""
    return f16[load_at(data, at, np.uint16)]


# --- one block type = _prep (scales of a group of 32 values) + _lane (one value) ----------
#
# A block holds 1 (32-value types) or 8 (K-quants) groups of 32 values; each group is two halves
# of 16 lanes, value 16 h + j, whose bytes are consecutive in j so that loops over j vectorize.
# The float ops follow codecs.py (gguf-py's order); _lane and _prep are compiled on their own,
# without contraction, so they give decode_f32's values bit for bit in every kernel.
#
# The helpers that branch on `kind` are functions of their own, which LLVM inlines with `kind` a
# constant, not inline="always": numba's inliner copies every branch of every kind into each call site,
# again for each nested call, and that made one type's kernels take ~75 s to compile (now ~25 s).


@njit(inline="always")
def _mxfp4_scale(e):
    """codecs.mxfp4_scale of one E8M0 byte: 2^(e - 128)."""
    return u32_as_f32(np.uint32(0x00200000) << e if e < 2 else np.uint32(e - 1) << 23)


@njit
def scale_min_k4(data, at, g):
    """6-bit scale and min of sub-block g from the 12 scale bytes at `at` (Q4_K, Q5_K)."""
    if g < 4:
        return _u8(data, at + g) & 63, _u8(data, at + g + 4) & 63
    lo = _u8(data, at + g + 4)
    return (lo & 15) | (_u8(data, at + g - 4) >> 6) << 4, (lo >> 4) | (_u8(data, at + g) >> 6) << 4


@njit
def _prep(kind, data, o, g, f16):
    """(scale, offset) of halves 0 and 1 of group g of the block at byte o."""
    zero = np.float32(0)
    if kind == _Q8_0 or kind == _Q4_0 or kind == _Q5_0:
        d = fp16_at(f16, data, o)
        return d, zero, d, zero
    if kind == _Q4_1 or kind == _Q5_1:
        d, m = fp16_at(f16, data, o), fp16_at(f16, data, o + 2)
        return d, m, d, m
    if kind == _Q4_K or kind == _Q5_K:
        sc, mn = scale_min_k4(data, o + 4, g)
        s, m = fp16_at(f16, data, o) * np.float32(sc), fp16_at(f16, data, o + 2) * np.float32(mn)
        return s, m, s, m
    if kind == _MXFP4:
        d = _mxfp4_scale(np.uint32(_u8(data, o)))
        return d, zero, d, zero
    if kind == _Q6_K:
        d = fp16_at(f16, data, o + 208)
        at = o + 192 + 2 * g  # int8 scales of 16 values each
        return d * np.float32(load_at(data, at, np.int8)), zero, d * np.float32(load_at(data, at + 1, np.int8)), zero
    return zero, zero, zero, zero


@njit(inline="always")
def _k4_scales_at(data, o, f16):
    """A float32 pointer to the 8 groups' scales, then their mins, of the Q4_K / Q5_K block at byte o
    (on the caller's stack)."""
    buf = stack_f32(16)
    k4_scales(data, o + 4, fp16_at(f16, data, o), fp16_at(f16, data, o + 2), buf)
    return buf


@njit(inline="always")
def _k4_block_scales(data, o, f16):
    """_k4_scales_at's values as an array (_prep's values)."""
    return carray(opaque(_k4_scales_at(data, o, f16)), 16)


@njit
def _q5(data, qh, qs, h, j0, jj):
    """Value 16 h + j0 + jj of a Q5_0/Q5_1 block: nibble from bytes `qs`, fifth bit from the 32 bits at `qh`."""
    top = _shr8(_u8(data, qh + 2 * h + (j0 >> 3)), jj) & 1
    return np.uint8((_u8(data, qs + j0 + jj) >> 4 * h & 15) | top << 4)


@njit(inline="always")
def _bits(byte, shift, mask):
    return np.uint8(_shr8(byte, shift) & mask)


@njit(inline="always")
def _plus(exact, a, b):
    if exact and a != a:
        return a
    return a + b


@njit
def _val(kind, data, o, k, f16):
    """Value k of a float-typed row whose values start at byte o."""
    if kind == _F32:
        return load_at(data, o + 4 * k, np.float32)
    if kind == _F16:
        return f16[load_at(data, o + 2 * k, np.uint16)]
    return u32_as_f32(np.uint32(load_at(data, o + 2 * k, np.uint16)) << 16)


@njit
def _lane(kind, exact, data, o, g, h, j0, jj, s, m, f16):
    """Value 16 h + j0 + jj (j0: 0 or 8, jj < 8) of group g of the block at byte o, given that half's scale s and offset m.

    With `exact`, q * d + m keeps the NaN of q * d when both are NaN, as numpy's add does: LLVM may
    swap the operands of an add, and x86 returns the first NaN operand.
    """
    j = j0 + jj
    if kind == _Q8_0:
        return np.float32(load_at(data, o + 2 + 16 * h + j, np.int8)) * s
    if kind == _Q4_0:
        return np.float32(np.int8((_u8(data, o + 2 + j) >> 4 * h & 15) - 8)) * s
    if kind == _Q4_1:
        return _plus(exact, np.float32(np.uint8(_u8(data, o + 4 + j) >> 4 * h & 15)) * s, m)
    if kind == _MXFP4:
        return np.float32(MXFP4_VALUES[_u8(data, o + 1 + j) >> 4 * h & 15]) * s
    if kind == _Q5_0:
        return np.float32(np.int8(_q5(data, o + 2, o + 6, h, j0, jj) - 16)) * s
    if kind == _Q5_1:
        return _plus(exact, np.float32(_q5(data, o + 4, o + 8, h, j0, jj)) * s, m)
    if kind == _Q4_K:
        q = _bits(_u8(data, o + 16 + 32 * (g >> 1) + 16 * h + j), 4 * (g & 1), 15)
        return np.float32(np.uint8(q)) * s - m
    if kind == _Q5_K:
        q = _bits(_u8(data, o + 48 + 32 * (g >> 1) + 16 * h + j), 4 * (g & 1), 15)
        q |= _bits(_u8(data, o + 16 + 16 * h + j), g, 1) << 4
        return np.float32(np.uint8(q)) * s - m
    if kind == _Q6_K:
        half, k, l = g >> 2, g & 3, 16 * h + j
        lo = _bits(_u8(data, o + 64 * half + 32 * (k & 1) + l), 4 * (k >> 1), 15)
        hi = _bits(_u8(data, o + 128 + 32 * half + l), 2 * k, 3)
        return np.float32(np.int8((lo | hi << 4) - 32)) * s
    return _val(kind, data, o, 16 * h + j, f16)


@njit
def _kq_pair(kind, data, o, p, j):
    """Values j of groups 2p and 2p + 1 of a Q4_K / Q5_K block (the low and high nibbles of one byte)."""
    if kind == _Q4_K:
        byte = _u8(data, o + 16 + 32 * p + j)
        return np.uint8(byte & 15), np.uint8(byte >> 4)
    byte, top = _u8(data, o + 48 + 32 * p + j), _u8(data, o + 16 + j)
    return (np.uint8((byte & 15) | (_shr8(top, 2 * p) & 1) << 4),
            np.uint8((byte >> 4) | (_shr8(top, 2 * p + 1) & 1) << 4))


@njit(inline="always")
def _is_float(kind):
    return kind == _F32 or kind == _F16 or kind == _BF16


# --- shared row loop pieces ---------------------------------------------------------


@njit(inline="always")
def chunk_bounds(c, nch, rows):
    return c * rows // nch, (c + 1) * rows // nch


@njit(inline="always")
def ahead_rows(kind, rnb):
    """How many rows ahead of the one being read the hints run: about _AHEAD (_AHEAD_K) bytes."""
    return max((_AHEAD_K if kind == _Q4_K or kind == _Q5_K or kind == _Q6_K else _AHEAD) // rnb, 1)


@njit(inline="always")
def row_at(offs, stride, r):
    """Byte offset of row r: offs[r], or r · stride in a table (stride > 0: an output head, whose
    rows need no offset array, which would be 8 bytes of anonymous memory a row)."""
    return r * stride if stride > 0 else offs[r]


@njit(inline="always")
def _row_ahead(offs, stride, rows, r, ahead):
    """Where the hints of row r go: the row `ahead` rows after it, or row r itself past the last.

    Rows need not be contiguous (a row order, a fused projection): the hints follow the rows read.
    """
    return row_at(offs, stride, r + ahead if r + ahead < rows else r)


@njit(inline="always")
def hint_block(data, at, b, bb):
    """Hints the lines of the row at byte `at` that start in its block b: one hint per 64 bytes,
    spread over the row as it is read. All of a row's hints at once as its reading starts (a
    burst) made cold rows 1.15-1.2x slower, side by side over every matrix of the 0.8B geometry.
    A loop of constant length (bb is): one of variable length compiled to ~40 instructions a block."""
    first, end = (b * bb + 63) // 64 * 64, (b + 1) * bb
    for k in range((bb + 63) // 64):  # the most lines that can start in a block
        if first + 64 * k < end:
            prefetch(data, at + first + 64 * k)


# --- kernels ------------------------------------------------------------------------


# A GEMV multiplies each block of W into up to MAX_GEMV_ROWS activation rows: the block is unpacked
# once into float32 values w (decode_f32's values, on the stack), which are fused into the
# accumulators of every row (blockir.fma_rows): row i's lane l sums w[l] · x[i, l] over the blocks
# in order, then its lanes are summed as one tree. A row's arithmetic does not depend on the other
# rows, so column i of the product is bit for bit the product of row i alone (the contract of batched
# decode); the one-row kernel is this code with n = 1, a constant LLVM folds.


@njit(inline="always")
def _put8(out, r, at, kind, data, o, g, h, j0, s, m, f16):
    for j in range(8):
        _put(kind, out, r, np.uint64(at + j), _lane(kind, True, data, o, g, h, j0, j, s, m, f16))


@njit(inline="always")
def _q5_block(kind, data, o, f16):
    """(values, d, m) of the Q5_0/Q5_1 block at byte o: its 32 values (0..31) unpacked as one byte
    vector (blockir.q5_values), its scale, and its offset (0 for Q5_0)."""
    qh_at = o + 2 if kind == _Q5_0 else o + 4
    d, m = fp16_at(f16, data, o), (np.float32(0) if kind == _Q5_0 else fp16_at(f16, data, o + 2))
    values = stack_bytes(32)
    q5_values(data, qh_at + 4, load_at(data, qh_at, np.uint32), values)
    return carray(values, 32), d, m


@njit(inline="always")
def _q6k_block(data, o, f16):
    """(values, scales) of the Q6_K block at byte o: its 256 values (-32..31, as int8 bits) and the 16
    scales (d · int8 scale, one per 16 values), each in one set of vector ops (blockir.q6k_values,
    q6k_scales16); the scales read back from memory (codegen.opaque)."""
    values, scales = stack_bytes(256), stack_f32(16)
    q6k_values(data, o, values)
    q6k_scales16(data, o + 192, fp16_at(f16, data, o + 208), scales)
    return carray(values, 256), carray(opaque(scales), 16)


@njit(inline="always")
def _unpack(kind, data, o, f16, w, q6, s6):
    """w[0 : values of a block] = the values of the block at byte o as float32. Float types and the
    32-value quants are unpacked in vector ops (blockir.values32), a Q6_K block's values and scales
    too (q6, s6: its bytes and scales, on the stack); Q4_K/Q5_K decode the 16 scales and mins of the
    block in one byte-vector op (blockir.k4_scales); under AVX-512 each Q4_0 / Q4_1 / MXFP4 value is picked
    from its block's 16 possible floats (blockir.q4_floats), each Q5_0 / Q5_1 value from its block's
    32 (blockir.q5_floats) and each Q4_K value from its group's 16 (blockir.q4k_floats), otherwise
    both nibbles of each byte are taken at once."""
    if kind == _Q4_K and AVX512:  # each value picked from its group's 16
        # the scales and mins read back from memory (codegen.opaque): each group's two are a broadcast
        # load and an FMA's broadcast operand, not ~4 shuffles on the pipes the picks need
        q4k_floats(data, o, opaque(_k4_scales_at(data, o, f16)), w)
    elif kind == _Q4_K or kind == _Q5_K:
        sm = _k4_block_scales(data, o, f16)
        wa = carray(w, 256)
        for p in range(4):  # groups 2p and 2p + 1: the low and high nibbles of the same 32 bytes
            s0, m0, s1, m1 = sm[2 * p], sm[8 + 2 * p], sm[2 * p + 1], sm[9 + 2 * p]
            for j in range(32):
                lo, hi = _kq_pair(kind, data, o, p, j)
                wa[64 * p + j] = np.float32(lo) * s0 - m0
                wa[64 * p + 32 + j] = np.float32(hi) * s1 - m1
    elif kind == _Q6_K:
        q6k_values(data, o, q6)
        q6k_scales16(data, o + 192, fp16_at(f16, data, o + 208), s6)
        if AVX512:  # read back from memory (codegen.opaque), each 16 values a sign-extending load and a
            # multiply by a broadcast operand, where LLVM kept the block in registers and split it and the
            # scales apart with ~2.5 shuffles a 16 values (under AVX2, emulated, no faster)
            q6k_floats(opaque(q6), opaque(s6), w)
        else:
            q6k_floats(q6, s6, w)
    elif _is_float(kind):
        values32(kind, data, o, np.uint32(0), np.float32(0), np.float32(0), w)
    elif kind == _Q5_0 or kind == _Q5_1:
        qh = o + 2 if kind == _Q5_0 else o + 4
        m = fp16_at(f16, data, o + 2) if kind == _Q5_1 else np.float32(0)
        if AVX512:  # each value picked from the block's 32
            q5_floats(kind, data, qh + 4, load_at(data, qh, np.uint32), fp16_at(f16, data, o), m, w)
        else:
            values32(kind, data, qh + 4, load_at(data, qh, np.uint32), fp16_at(f16, data, o), m, w)
    elif kind == _MXFP4:  # under AVX-512 each value picked from the block's 16
        d = _mxfp4_scale(np.uint32(_u8(data, o)))
        if AVX512:
            q4_floats(kind, data, o + 1, d, np.float32(0), w)
        else:
            values32(kind, data, o + 1, np.uint32(0), d, np.float32(0), w)
    else:  # Q8_0, Q4_0, Q4_1
        at = o + 4 if kind == _Q4_1 else o + 2
        m = fp16_at(f16, data, o + 2) if kind == _Q4_1 else np.float32(0)
        if kind != _Q8_0 and AVX512:  # each value picked from the block's 16
            q4_floats(kind, data, at, fp16_at(f16, data, o), m, w)
        else:
            values32(kind, data, at, np.uint32(0), fp16_at(f16, data, o), m, w)


@njit(inline="always")
def _pass(kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, rows, pair, f16, out, col, col2,
          acc, acc2, w, w2, q6, s6):
    """out[i0 + i, col] = x[i0 + i] · the row of W at byte `row`, for i < rows (a constant) with
    i0 + i < end, and when pair (a constant) is 2 also out[i0 + i, col2] = x[i0 + i] · the row at byte
    row2: each block unpacked once into w (w2) and fused into every row's accumulators (acc, acc2), 2
    vectors of 16 lanes a row (lane l sums the values 32 k + l of every block, k in order); in a pair
    each vector of x is loaded once for both rows of W. A pair of one row with itself (col2 == col)
    stores it once. xs is x as fma_rows reads it; x itself gives a float row's last width % 32 values."""
    acc_zero(acc, rows, 2)
    acc_zero(acc2, rows, 2)
    for b in range(nblk):
        if i0 == 0:
            hint_block(data, hint, b, bb)
            if pair == 2:
                hint_block(data, hint2, b, bb)
        _unpack(kind, data, row + b * bb, f16, w, q6, s6)
        if pair == 2:
            _unpack(kind, data, row2 + b * bb, f16, w2, q6, s6)
        if vb == 256:
            fma_rows(acc, w, acc2, w2, pair, xs, i0, end, nblk * vb, 256 * b, rows, 2, 8)
        else:
            fma_rows(acc, w, acc2, w2, pair, xs, i0, end, nblk * vb, 32 * b, rows, 2, 1)
    for p in range(1 if col2 == col else pair):
        at, c, a = (row, col, acc) if p == 0 else (row2, col2, acc2)
        acc_store(a, rows, 2, out, i0, end, c)
        for i in range(min(rows, end - i0)):  # a float row's last width % 32 values
            for k in range(tail):
                out[i0 + i, c] += _val(kind, data, at + nblk * bb, k, f16) * x[i0 + i, nblk * vb + k]


@njit(inline="always")
def interleaved(x, width):
    """The first `width` (a multiple of 32) values of each row of x in the groups of rows of x that
    _gemv_rows' passes take (_group), one after another, the rows of each interleaved 32 values at a
    time: x[i0 + i, 32 k + j] at [width i0 + 32 (k g + i) + j] for the group of g rows from i0
    (blockir.fma_rows' 1-D x). Interleaved across every row, 2 rows of 16 (AVX2) were 128 bytes in
    each 2 KiB, a few sets of L1 that could not hold them: 1.43x the time at 16 rows."""
    n = x.shape[0]
    xs = np.empty(n * width, np.float32)
    i0 = 0
    while i0 < n:
        g = _group(32, n - i0)
        for k in range(width // 32):
            for i in range(g):
                for j in range(32):
                    xs[width * i0 + 32 * (k * g + i) + j] = x[i0 + i, 32 * k + j]
        i0 += g
    return xs


@njit(inline="always")
def _gemv_one(kind, vb, bb, data, offs, stride, rows, x, f16, out, lo, r0, r1, nblk, tail, rnb):
    """out[0, lo + r] = x[0] · dequant(row r) for rows r0..r1 of W (at row_at): a pass over each. (Passes over pairs
    of rows, each row's two accumulator chains beside the other's, took 2-17 % less time on matrices in the caches
    (one thread, bench/matmul.py's shapes), but a decode step streaming its weights from memory on two threads
    took 6-13 % more: LFM2 1.2B Q8_0, Llama 3.2 1B q4_k_m, 2026-12-05.)"""
    ahead = ahead_rows(kind, rnb)
    acc, w = acc_vectors(16), stack_f32(256)
    q6, s6 = stack_bytes(256), stack_f32(16)
    for r in range(r0, r1):
        row, hint = row_at(offs, stride, r), _row_ahead(offs, stride, rows, r, ahead)
        _pass(kind, vb, bb, data, row, row, hint, hint, nblk, tail, x, x, 0, 1, 1, 1, f16, out, lo + r, lo + r,
              acc, acc, w, w, q6, s6)


# Rows of W a pass of _gemv_rows goes over: 2 under AVX-512, 1 under AVX2; and of a tile, which every
# group of rows of x passes over in turn (16 rows of 1,024 Q8_0 values: 17 KiB; tiles of 8 and 32 rows
# measured no faster at 8 rows of x, bench/matmul.py).
_W_ROWS = 2 if AVX512 else 1
_TILE = 16
# The most rows of x a pass of _gemv_rows takes: under AVX-512 6 (24 accumulators with the pair of rows
# of W), so that 5 rows take one pass, where a pass of 4 and another of 2 unpacked every block twice
# (5 rows 0.71-0.88x the time of those, Q8_0, Q4_K and Q6_K at bench/matmul.py's shapes, side by side).
_X_ROWS = 6 if AVX512 else 2


@njit(inline="always")
def _group(vb, left):
    """Rows of x that the next pass of _gemv_rows takes, `left` rows being left: the fewest passes
    of at most _X_ROWS, sharing the rows evenly (8 rows as 4 + 4: 6 + 2 took 1.05-1.09x the time);
    for 256-value blocks, whose passes compute 2, 4 or 6 rows, rounded up to the next of those."""
    passes = (left + _X_ROWS - 1) // _X_ROWS
    rows = (left + passes - 1) // passes
    return rows if vb == 32 else min((rows + 1) // 2 * 2, _X_ROWS)


# The passes of a group of rows of x (_gemv_rows' group_pass): each few-row kernel names its own, so
# that it compiles only those (numba compiles both sides of a branch on vb: Q8_0's took 6.5 s with
# the passes of both, 3.5 s without). A global, not a closure's variable: numba caches no kernel
# that refers to a jitted function through one.


@njit(inline="always")
def _one_shape(group, kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, f16, out, col, col2,
               acc, acc2, w, w2, q6, s6):
    """_pass over 32-value blocks: one pass of _X_ROWS rows serves every group, rows past end skipped."""
    _pass(kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, _X_ROWS, _W_ROWS, f16, out, col,
          col2, acc, acc2, w, w2, q6, s6)


@njit(inline="always")
def _three_shapes(group, kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, f16, out, col, col2,
                  acc, acc2, w, w2, q6, s6):
    """_pass over 256-value blocks: of `group` rows (_X_ROWS, 4 or 2), rows past end repeating its last."""
    if group == _X_ROWS:
        _pass(kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, _X_ROWS, _W_ROWS, f16, out, col,
              col2, acc, acc2, w, w2, q6, s6)
    elif group == 4:
        _pass(kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, 4, _W_ROWS, f16, out, col,
              col2, acc, acc2, w, w2, q6, s6)
    else:
        _pass(kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, 2, _W_ROWS, f16, out, col,
              col2, acc, acc2, w, w2, q6, s6)


@njit(inline="always")
def _gemv_rows(group_pass, kind, vb, bb, data, offs, stride, rows, x, xs, n, f16, out, lo, r0, r1, nblk, tail, rnb):
    """out[i, lo + r] = x[i] · dequant(row r) for rows r0..r1 of W (at row_at) and the n >= 2 rows of
    x (xs: x as fma_rows reads it). Passes of up to _X_ROWS rows of x (_group) over pairs of rows of
    W under AVX-512 (an odd last row of a tile pairs with itself), over each row under AVX2. Over
    32-value blocks a pass's rows past its last are skipped, so one compiled pass serves every group
    (x interleaved 32 values at a time, so the rows of a block lie side by side: as rows 4 KiB apart
    they took 1.03-1.16x the time); over 256-value blocks they repeat its last (computed, never
    stored), in passes of 6, 4 or 2 rows. The rows of W go in tiles of _TILE: every pass of one group
    of rows of x over the tile, then the next group's over the same rows of W, from the caches: a
    group's x stays in L1 over the tile (one group after another over each pair, the x of 8 rows,
    32 KiB at a width of 1,024, came from L2). Row i's arithmetic is _gemv_one's."""
    ahead = ahead_rows(kind, rnb)
    acc, acc2, w, w2 = acc_vectors(12), acc_vectors(12), stack_f32(256), stack_f32(256)
    q6, s6 = stack_bytes(256), stack_f32(16)
    for t0 in range(r0, r1, _TILE):
        t1 = min(t0 + _TILE, r1)
        i0 = 0
        while i0 < n:
            group = _group(vb, n - i0)
            for r in range(t0, t1, _W_ROWS):
                r2 = min(r + _W_ROWS - 1, t1 - 1)
                row, hint = row_at(offs, stride, r), _row_ahead(offs, stride, rows, r, ahead)
                row2, hint2 = row_at(offs, stride, r2), _row_ahead(offs, stride, rows, r2, ahead)
                end = min(i0 + group, n)
                group_pass(group, kind, vb, bb, data, row, row2, hint, hint2, nblk, tail, x, xs, i0, end, f16, out,
                           lo + r, lo + r2, acc, acc2, w, w2, q6, s6)
            i0 += group


def _matmul_kernels(kind: int, vb: int, bb: int) -> tuple:
    """(mv, mm): out[:, lo + r] = x @ dequant(row r) for one activation row (mv: _gemv_one) or
    2 to MAX_GEMV_ROWS (mm: _gemv_rows), for a block type of vb values in bb bytes (32 in 32 x size
    for floats); mm's column i is mv's product of row i, bit for bit. Rows are at offs[r], or at
    r · stride when stride > 0 (a table)."""
    # Rows of float types end in a partial "block" of width % 32 values, each of bb // 32 bytes.
    value_bytes = bb // 32 if kind in (_F32, _F16, _BF16) else 0

    # Two functions, not two branches of one: a second parfor in the same function made the
    # one-row loop 5-13 % slower (measured side by side).
    @kernel_of(GGMLType(kind).name, parallel=True, fastmath={"contract"})
    def mv(data, offs, stride, rows, x, f16, out, lo, width, nch):
        nblk, tail = width // vb, width % vb
        rnb = max(nblk * bb + tail * value_bytes, 1)
        for c in prange(nch):
            wide_vectors()
            r0, r1 = chunk_bounds(c, nch, rows)
            _gemv_one(kind, vb, bb, data, offs, stride, rows, x, f16, out, lo, r0, r1, nblk, tail, rnb)

    if vb == 32:

        @kernel_of(GGMLType(kind).name, parallel=True, fastmath={"contract"})
        def mm(data, offs, stride, rows, x, f16, out, lo, width, nch):
            nblk, tail = width // vb, width % vb
            rnb = max(nblk * bb + tail * value_bytes, 1)
            xs = interleaved(x, nblk * vb)
            for c in prange(nch):
                wide_vectors()
                r0, r1 = chunk_bounds(c, nch, rows)
                _gemv_rows(_one_shape, kind, vb, bb, data, offs, stride, rows, x, xs, x.shape[0], f16, out, lo, r0, r1,
                           nblk, tail, rnb)

    else:

        @kernel_of(GGMLType(kind).name, parallel=True, fastmath={"contract"})
        def mm(data, offs, stride, rows, x, f16, out, lo, width, nch):
            nblk = width // vb
            rnb = max(nblk * bb, 1)
            for c in prange(nch):
                wide_vectors()
                r0, r1 = chunk_bounds(c, nch, rows)
                _gemv_rows(_three_shapes, kind, vb, bb, data, offs, stride, rows, x, x, x.shape[0], f16, out, lo, r0, r1,
                           nblk, 0, rnb)

    return mv, mm


def _put(kind, out, r, k, v):
    """out[r, k] = v, or its bf16 bits into uint16 `out` (BF16 weights: the stored bits, NaNs as they are)."""


@overload(_put)
def _put_impl(kind, out, r, k, v):
    if out.dtype == types.uint16:

        def put_bf16(kind, out, r, k, v):
            out[r, k] = f32_bits(v) >> 16 if kind == _BF16 else bf16_bits(v)

        return put_bf16

    def put(kind, out, r, k, v):
        out[r, k] = v

    return put


@njit(inline="always")
def _put_q4(kind, out, r, at, data, o, f16):
    """out[r, at : at + 32] = the Q4_0/Q4_1 block at byte o, both nibbles of each byte at once."""
    d, m = fp16_at(f16, data, o), (np.float32(0) if kind == _Q4_0 else fp16_at(f16, data, o + 2))
    qs = o + 2 if kind == _Q4_0 else o + 4
    for j in range(16):
        b = _u8(data, qs + j)
        if kind == _Q4_0:
            _put(kind, out, r, np.uint64(at + j), np.float32(np.int8((b & 15) - 8)) * d)
            _put(kind, out, r, np.uint64(at + 16 + j), np.float32(np.int8((b >> 4) - 8)) * d)
        else:
            _put(kind, out, r, np.uint64(at + j), _plus(True, np.float32(np.uint8(b & 15)) * d, m))
            _put(kind, out, r, np.uint64(at + 16 + j), _plus(True, np.float32(np.uint8(b >> 4)) * d, m))


@njit(inline="always")
def _put_mxfp4(kind, out, r, at, data, o, f16, w):
    """out[r, at : at + 32] = the MXFP4 block at byte o, unpacked as the GEMV unpacks it (_unpack,
    into w: 32 float32 on the stack): the same values as _lane's, in vector ops."""
    _unpack(kind, data, o, f16, w, w, w)
    values = carray(w, 32)
    for j in range(32):
        _put(kind, out, r, np.uint64(at + j), values[j])


@njit(inline="always")
def _put_q5(kind, out, r, at, data, o, f16):
    """out[r, at : at + 32] = the Q5_0/Q5_1 block at byte o, unpacked as one byte vector
    (_q5_block): 1.6-1.7x the rate of _lane's per-value fifth bits, the same values."""
    q, d, m = _q5_block(kind, data, o, f16)
    for j in range(32):
        if kind == _Q5_0:
            _put(kind, out, r, np.uint64(at + j), np.float32(np.int8(q[j] - 16)) * d)
        else:
            _put(kind, out, r, np.uint64(at + j), _plus(True, np.float32(q[j]) * d, m))


@njit(inline="always")
def _put_q6k(kind, out, r, at, data, o, f16):
    """out[r, at : at + 256] = the Q6_K block at byte o, unpacked as the GEMV unpacks it (_q6k_block):
    the same values as _lane's."""
    q, s = _q6k_block(data, o, f16)
    for g in range(16):
        sg = s[g]
        for j in range(16):
            _put(kind, out, r, np.uint64(at + 16 * g + j), np.float32(np.int8(q[16 * g + j])) * sg)


def _dequant_kernel(kind: int, vb: int, bb: int):
    """out[r] = dequant(row r) as float32, or as bf16 bits into uint16; compiled without contraction."""
    groups = vb // 32
    value_bytes = bb // 32 if kind in (_F32, _F16, _BF16) else 0

    @kernel_of(GGMLType(kind).name, parallel=True)
    def dequant(data, offs, f16, out, nch):
        rows, width = out.shape
        nblk, tail = width // vb, width % vb
        rnb = max(nblk * bb + tail * value_bytes, 1)
        for c in prange(nch):
            wide_vectors()
            keep_loops()
            r0, r1 = chunk_bounds(c, nch, rows)
            ahead = ahead_rows(kind, rnb)
            w = stack_f32(32)
            for r in range(r0, r1):
                row, hint = offs[r], _row_ahead(offs, 0, rows, r, ahead)
                for b in range(nblk):
                    o = row + b * bb
                    hint_block(data, hint, b, bb)
                    if kind == _MXFP4:
                        _put_mxfp4(kind, out, r, b * 32, data, o, f16, w)
                        continue
                    if kind == _Q4_0 or kind == _Q4_1:
                        _put_q4(kind, out, r, b * 32, data, o, f16)
                        continue
                    if kind == _Q5_0 or kind == _Q5_1:
                        _put_q5(kind, out, r, b * 32, data, o, f16)
                        continue
                    if kind == _Q6_K:
                        _put_q6k(kind, out, r, b * 256, data, o, f16)
                        continue
                    for g in range(groups):
                        xo = b * vb + 32 * g
                        s0, m0, s1, m1 = _prep(kind, data, o, g, f16)
                        _put8(out, r, xo, kind, data, o, g, 0, 0, s0, m0, f16)
                        _put8(out, r, xo + 8, kind, data, o, g, 0, 8, s0, m0, f16)
                        _put8(out, r, xo + 16, kind, data, o, g, 1, 0, s1, m1, f16)
                        _put8(out, r, xo + 24, kind, data, o, g, 1, 8, s1, m1, f16)
                for k in range(tail):
                    _put(kind, out, r, nblk * vb + k, _val(kind, data, row + nblk * bb, k, f16))

    return dequant


def _dequant_kq_kernel(kind: int, bb: int):
    """As _dequant_kernel for Q4_K / Q5_K, two groups at a time: both nibbles of each byte, so the
    loop over a group's 32 values vectorizes (the per-group variable shift kept it scalar)."""

    @kernel_of(GGMLType(kind).name, parallel=True)
    def dequant(data, offs, f16, out, nch):
        rows, width = out.shape
        nblk = width // 256
        rnb = max(nblk * bb, 1)
        for c in prange(nch):
            wide_vectors()
            r0, r1 = chunk_bounds(c, nch, rows)
            ahead = ahead_rows(kind, rnb)
            for r in range(r0, r1):
                hint = _row_ahead(offs, 0, rows, r, ahead)
                for b in range(nblk):
                    o = offs[r] + b * bb
                    hint_block(data, hint, b, bb)
                    sm = _k4_block_scales(data, o, f16)
                    for p in range(4):
                        s0, m0, s1, m1 = sm[2 * p], sm[8 + 2 * p], sm[2 * p + 1], sm[9 + 2 * p]
                        at = b * 256 + 64 * p
                        for j in range(32):
                            lo, hi = _kq_pair(kind, data, o, p, j)
                            _put(kind, out, r, np.uint64(at + j), np.float32(lo) * s0 - m0)
                            _put(kind, out, r, np.uint64(at + 32 + j), np.float32(hi) * s1 - m1)

    return dequant


def _kernels(t: GGMLType) -> tuple:
    vb, bb = BLOCK_LAYOUT[t]
    if vb == 1:  # float types: 32 values at a time
        vb, bb = 32, 32 * bb
    dequant = _dequant_kq_kernel(int(t), bb) if t in (_T.Q4_K, _T.Q5_K) else _dequant_kernel(int(t), vb, bb)
    return _matmul_kernels(int(t), vb, bb), dequant, BLOCK_LAYOUT[t][0]


_KERNELS = {t: _kernels(t) for t in sorted(DECODABLE)}


# --- public API ---------------------------------------------------------------------


def _block(ggml_type) -> tuple:
    k = _KERNELS.get(ggml_type)
    if k is None:
        t = as_ggml_type(ggml_type)
        raise UnsupportedError(f"no matmul kernel for GGML type {t.name}")
    return k


def readonly(a: np.ndarray) -> np.ndarray:
    """`a`, or a read-only view of it: the kernels are compiled for read-only inputs (what the file
    map gives); a view costs ~0.2 us."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def gemv_kernels(ggml_type) -> tuple:
    """The compiled (one-row, few-row) GEMVs of a type, for compiled callers: their arguments are
    rows_matmul's unchecked (data, offsets, 0, rows, x, f16 table, out, out_lo, width, chunks)."""
    return _block(ggml_type)[0]


def thread_chunks(rows: int) -> int:
    # One contiguous chunk of rows per thread, so each thread's prefetch hints run ahead of it unbroken.
    return max(min(rows, kernel_threads()), 1)


def _check_array(name: str, a, dtype, ndim: int) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim and a.flags.c_contiguous):
        raise ValueError(
            f"{name} must be a C-contiguous {ndim}-D {np.dtype(dtype).name} array, got "
            f"{getattr(a, 'dtype', type(a).__name__)} with shape {getattr(a, 'shape', None)}"
        )


def rows_matmul(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int,
                x: np.ndarray, out: np.ndarray, out_lo: int = 0) -> None:
    """out[:, out_lo : out_lo + len(row_offsets)] = x @ W.T where W[r] = dequant(row at data[row_offsets[r]:]).

    data: 1-D uint8 (normally the read-only file map), row_offsets: 1-D int64, both validated once by
    check_rows; x: float32 (n, width) C-contiguous, 1 <= n <= MAX_GEMV_ROWS; out: float32 (n, total)
    C-contiguous writeable. fp32 accumulation of the dequantized weights (decode_f32's values, with
    FMA contraction). Runs on numba's threads (numba.set_num_threads), one contiguous chunk of rows each.
    """
    vb = _block(ggml_type)[2]
    _check_array("x", x, np.float32, 2)
    _check_array("out", out, np.float32, 2)
    n = x.shape[0]
    if not 1 <= n <= MAX_GEMV_ROWS or x.shape[1] != width or width % vb:
        raise ValueError(f"x must have shape (n, {width}) with 1 <= n <= {MAX_GEMV_ROWS}, got {x.shape}")
    if out.shape[0] != n or not 0 <= out_lo <= out.shape[1] - len(row_offsets) or not out.flags.writeable:
        raise ValueError(
            f"out must be writeable with {n} rows and columns {out_lo}..{out_lo + len(row_offsets)}, "
            f"got shape {out.shape}"
        )
    bound_rows_matmul(data, ggml_type, row_offsets, width)(x, out, out_lo)


def bound_rows_matmul(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int, out_lo: int = 0):
    """rows_matmul over these rows (validated by check_rows) as a function (x, out[, out_lo]) that
    checks nothing per call, for an operator that makes x and out itself: a decode step makes ~100
    such calls, and rows_matmul's checks cost ~7 us each."""
    (mv, mm), offs, data = _block(ggml_type)[0], readonly(row_offsets), readonly(data)
    rows = len(offs)

    def run(x: np.ndarray, out: np.ndarray, out_lo: int = out_lo) -> None:
        (mv if x.shape[0] == 1 else mm)(data, offs, 0, rows, readonly(x), F16_TO_F32, out, out_lo, width, thread_chunks(rows))

    return run


_NO_OFFSETS = np.zeros(0, np.int64)
_NO_OFFSETS.flags.writeable = False

# Types whose GEMV multiplies a whole table, its rows addressed by stride (an output head).
TABLE_TYPES = frozenset({_T.Q8_0, _T.Q6_K})


def table_matmul(table: np.ndarray, ggml_type, x: np.ndarray, out: np.ndarray) -> None:
    """out[i, v] = x[i] · dequant(table[v]) for a C-contiguous (rows, row_nbytes) uint8 table of one of
    TABLE_TYPES, x float32 (n, width) and out float32 (n, rows), n <= MAX_GEMV_ROWS, as checked by
    head.head_logits; row i of out is bit for bit what x[i] alone gives."""
    (mv, mm), _, vb = _block(ggml_type)
    rows, nbytes = table.shape
    width = nbytes // BLOCK_LAYOUT[ggml_type][1] * vb
    (mv if x.shape[0] == 1 else mm)(readonly(table).reshape(-1), _NO_OFFSETS, nbytes, rows, readonly(x),
                                    F16_TO_F32, out, 0, width, thread_chunks(rows))


def rows_dequantize(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int, out: np.ndarray) -> None:
    """out[r] = dequant(row r): float32 out gets decode_f32's values bit for bit, uint16 out the bf16
    bits of those values rounded to nearest even (decode_bf16's). Parallel over rows on numba's threads.
    """
    _, dequant, vb = _block(ggml_type)
    if not (isinstance(out, np.ndarray) and out.dtype in (np.float32, np.uint16)):
        raise ValueError(f"out must be float32 or uint16 (bf16 bits), got {getattr(out, 'dtype', type(out).__name__)}")
    _check_array("out", out, out.dtype, 2)
    if out.shape != (len(row_offsets), width) or width % vb or not out.flags.writeable:
        raise ValueError(f"out must be writeable with shape ({len(row_offsets)}, {width}), got {out.shape}")
    dequant(readonly(data), readonly(row_offsets), F16_TO_F32, out, thread_chunks(len(row_offsets)))


def check_rows(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int) -> None:
    """Validates, once at load, what rows_matmul and rows_dequantize then trust: the type has kernels,
    width is a whole number of blocks, and every row lies inside data."""
    t = as_ggml_type(ggml_type)
    if t not in _KERNELS:
        raise UnsupportedError(f"no matmul kernel for GGML type {t.name}")
    _check_array("data", data, np.uint8, 1)
    _check_array("row_offsets", row_offsets, np.int64, 1)
    vb, bb = BLOCK_LAYOUT[t]
    if width < 0 or width % vb:
        raise ModelFormatError(f"{t.name}: a row of {width} values is not a whole number of {vb}-value blocks")
    nbytes = width // vb * bb
    bad = np.flatnonzero((row_offsets < 0) | (row_offsets > data.size - nbytes))
    if len(bad):
        i = int(bad[0])
        raise ModelFormatError(
            f"{t.name}: row {i} at byte offset {int(row_offsets[i])} ({nbytes} bytes) lies outside "
            f"the {data.size} bytes of data"
        )


KERNEL_PARTS = ("one-row", "few-row", "dequantize")


def warmup(types=None, parts=KERNEL_PARTS, dequantize_to=(np.float32, np.uint16)) -> None:
    """Compiles the kernels of `types` (default: every type), or loads them from numba's cache, on
    tiny inputs: of `parts`, the one-row GEMVs, the few-row GEMVs and the dequantizers (each part is
    one compiled function per type, with one numba cache index), these to the dtypes `dequantize_to`
    (float32, uint16: bf16 bits). Each type's compiled code costs ~1 MiB of anonymous memory once loaded."""
    for t, (_, _, vb) in _KERNELS.items():
        if types is not None and t not in types:
            continue
        width = max(vb, 32)
        data = np.zeros(BLOCK_LAYOUT[t][1] * width // vb, np.uint8)
        offs = np.zeros(1, np.int64)
        for n, part in ((1, "one-row"), (2, "few-row")):
            if part in parts:
                rows_matmul(data, t, offs, width, np.zeros((n, width), np.float32), np.empty((n, 1), np.float32))
        if "dequantize" in parts:
            for dtype in dequantize_to:
                rows_dequantize(data, t, offs, width, np.empty((1, width), dtype))
