"""The opt-in int8-activation GEMV (weights "mapped-int8"): llama.cpp's scheme, not fp32-exact.

One activation row is quantized once per operator call to int8 in groups of 32 values (a float32
scale each, round to nearest), and every 32 weights of a block are multiplied by their 32 int8
activations in integer arithmetic (AVX2 `vpmaddubsw` of unsigned weight values by signed
activations, then `vpmaddwd`), the block's scales applied to the eight int32 lanes in float.
Weights whose values are stored with an offset (Q4_0's q - 8, Q6_K's q - 32) or a minimum
(Q4_1, Q5_1, the K-quants) take it through the sums of the quantized activations (per 32 values;
per 16 under Q6_K's scales). Layers' rows are addressed by offset, an output head's by stride.
Kernels read the uint8 array they are handed (normally the read-only file map), never copy it.
"""

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagelm.errors import UnsupportedError
from pagelm.quant.blockir import I8, I32, V32I8, bytes_at, nibbles16, q5_group
from pagelm.quant.codegen import F16_TO_F32, wide_vectors, kernel_of
from pagelm.quant.head import check_table
from pagelm.quant.matmul import (
    ahead_rows,
    chunk_bounds,
    thread_chunks,
    fp16_at,
    hint_block,
    load_at,
    row_at,
    scale_min_k4,
    readonly,
)
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type

GROUP = 32  # activation values per float32 scale

_T = GGMLType
_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1 = int(_T.Q8_0), int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q5_1)
_Q4_K, _Q5_K, _Q6_K = int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)
INT8_TYPES = frozenset(GGMLType(k) for k in (_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q4_K, _Q5_K, _Q6_K))


def available() -> bool:
    """The kernels use AVX2 instructions directly; elsewhere weights="mapped-int8" is refused."""
    return "+avx2" in llvm.get_host_cpu_features().flatten().split(",")


# --- IR pieces ----------------------------------------------------------------------

_I16 = ir.IntType(16)
_V16I16, _V8I32, _V8F32 = ir.VectorType(_I16, 16), ir.VectorType(I32, 8), ir.VectorType(ir.FloatType(), 8)


def _call(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, value, vtype):
    vec = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(vec, ir.Constant(vtype, ir.Undefined), ir.Constant(ir.VectorType(I32, vtype.count), None))


def _low_bits(builder, v, shift, bits):
    """(v >> shift) & (2**bits - 1) per byte of <32 x i8> v; shift an intp."""
    shifted = builder.lshr(v, _splat(builder, builder.trunc(shift, I8), V32I8))
    return builder.and_(shifted, ir.Constant(V32I8, (1 << bits) - 1))


def _accumulate(builder, acc, w, x, scales, scale):
    """acc (<8 x float> at pointer acc) += scale * int32 lanes of sum(w * x * scales): w unsigned
    bytes (<= 128 each), x signed bytes, scales int16 per pair of 16-bit products (<16 x i16>)."""
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, w, x)
    lanes = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, pairs, scales)
    vec_ptr = builder.bitcast(acc, _V8F32.as_pointer())
    total = builder.fadd(builder.load(vec_ptr, align=4),
                         builder.fmul(builder.sitofp(lanes, _V8F32), _splat(builder, scale, _V8F32)))
    builder.store(total, vec_ptr, align=4)


def _ones():
    return ir.Constant(_V16I16, 1)


def _halves(builder, lo, hi):
    """int16 scales: lo for the pair sums of bytes 0-15, hi for bytes 16-31."""
    v = builder.insert_element(ir.Constant(ir.VectorType(_I16, 2), ir.Undefined), builder.trunc(lo, _I16), I32(0))
    v = builder.insert_element(v, builder.trunc(hi, _I16), I32(1))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), [0] * 8 + [1] * 8))


_ACC = types.CPointer(types.float32)


@intrinsic
def _acc8(typingctx):
    """Eight float32 accumulators on the stack (zeroed)."""

    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, _V8F32)
        builder.store(ir.Constant(_V8F32, None), ptr)
        return builder.bitcast(ptr, ir.FloatType().as_pointer())

    return _ACC(), codegen


@intrinsic
def _acc8_take(typingctx, acc):
    """The sum of the eight accumulators; zeroes them."""

    def codegen(context, builder, signature, args):
        ptr = builder.bitcast(args[0], _V8F32.as_pointer())
        v = builder.load(ptr, align=4)
        builder.store(ir.Constant(_V8F32, None), ptr, align=4)
        for width in (4, 2, 1):
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, I32(0))

    return types.float32(acc), codegen


@intrinsic
def _dot_q8(typingctx, data, at, xq, xat, acc, scale):
    """acc += scale * w·x over 32 signed weight bytes at data[at] and xq[xat:] (|w| times x signed as w)."""

    def codegen(context, builder, signature, args):
        w = bytes_at(context, builder, signature.args[0], args[0], args[1])
        x = bytes_at(context, builder, signature.args[2], args[2], args[3])
        magnitude = _call(builder, "llvm.abs.v32i8", V32I8, w, ir.Constant(ir.IntType(1), 0))
        signed_x = _call(builder, "llvm.x86.avx2.psign.b", V32I8, x, w)
        _accumulate(builder, args[4], magnitude, signed_x, _ones(), args[5])
        return context.get_dummy_value()

    return types.void(data, at, xq, xat, acc, scale), codegen


@intrinsic
def _dot_q4(typingctx, data, at, xq, xat, acc, scale):
    """acc += scale * q·x, q the 32 nibbles of the 16 bytes at data[at] (Q4_0, Q4_1 order)."""

    def codegen(context, builder, signature, args):
        w = nibbles16(context, builder, signature.args[0], args[0], args[1])
        x = bytes_at(context, builder, signature.args[2], args[2], args[3])
        _accumulate(builder, args[4], w, x, _ones(), args[5])
        return context.get_dummy_value()

    return types.void(data, at, xq, xat, acc, scale), codegen


@intrinsic
def _dot_q5(typingctx, data, at, qh, xq, xat, acc, scale):
    """As _dot_q4, each value's fifth bit from bit j of uint32 qh (Q5_0, Q5_1)."""

    def codegen(context, builder, signature, args):
        w = q5_group(context, builder, signature.args[0], args[0], args[1], args[2])
        x = bytes_at(context, builder, signature.args[3], args[3], args[4])
        _accumulate(builder, args[5], w, x, _ones(), args[6])
        return context.get_dummy_value()

    return types.void(data, at, qh, xq, xat, acc, scale), codegen


@intrinsic
def _dot_kq(typingctx, data, at, shift, qh_at, bit, xq, xat, acc, scale):
    """acc += scale * q·x, q = (byte j at data[at] >> shift) & 15, with (when qh_at >= 0) bit `bit`
    of byte j at data[qh_at] as its fifth bit (Q4_K, Q5_K)."""

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        w = _low_bits(builder, bytes_at(context, builder, arrty, args[0], args[1]), args[2], 4)
        with_top = builder.icmp_signed(">=", args[3], ir.Constant(args[3].type, 0))
        top_at = builder.select(with_top, args[3], args[1])  # a valid address either way
        top = builder.shl(_low_bits(builder, bytes_at(context, builder, arrty, args[0], top_at), args[4], 1),
                          ir.Constant(V32I8, 4))
        w = builder.select(with_top, builder.or_(w, top), w)
        x = bytes_at(context, builder, signature.args[5], args[5], args[6])
        _accumulate(builder, args[7], w, x, _ones(), args[8])
        return context.get_dummy_value()

    return types.void(data, at, shift, qh_at, bit, xq, xat, acc, scale), codegen


@intrinsic
def _dot_q6(typingctx, data, ql_at, shift, qh_at, qshift, xq, xat, acc, scale, s_lo, s_hi):
    """acc += scale * sum(q·x·s), q = (ql >> shift & 15) | (qh >> qshift & 3) << 4 over 32 bytes
    each, s the int8 scale s_lo of the first 16 values and s_hi of the last (Q6_K)."""

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        lo = _low_bits(builder, bytes_at(context, builder, arrty, args[0], args[1]), args[2], 4)
        hi = _low_bits(builder, bytes_at(context, builder, arrty, args[0], args[3]), args[4], 2)
        w = builder.or_(lo, builder.shl(hi, ir.Constant(V32I8, 4)))
        x = bytes_at(context, builder, signature.args[5], args[5], args[6])
        _accumulate(builder, args[7], w, x, _halves(builder, args[9], args[10]), args[8])
        return context.get_dummy_value()

    return types.void(data, ql_at, shift, qh_at, qshift, xq, xat, acc, scale, s_lo, s_hi), codegen


# --- activations ----------------------------------------------------------------------


@njit(cache=True)
def _quantize(x, xq, xd, xs, xm):
    for g in range(len(xd)):
        amax = np.float32(0)
        for j in range(GROUP):
            amax = max(amax, abs(x[GROUP * g + j]))
        d = amax / np.float32(127)
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        xd[g] = d
        for h in range(2):
            s = np.int32(0)
            for j in range(16):
                q = np.int8(np.rint(x[GROUP * g + 16 * h + j] * inv))
                xq[GROUP * g + 16 * h + j] = q
                s = np.int32(s + np.int32(q))
            xs[2 * g + h] = s
        xm[g] = d * np.float32(xs[2 * g] + xs[2 * g + 1])


class Int8Row:
    """One activation row quantized for the int8 kernels: values (int8), a float32 scale per 32,
    the int32 sum of the quantized values per 16, and per 32 the sum of the values they stand for."""

    __slots__ = ("xq", "xd", "xs", "xm")

    def __init__(self, x: np.ndarray):
        width = x.shape[0]
        if width % GROUP:
            raise ValueError(f"an int8 activation row must be a whole number of {GROUP}-value groups, got {width}")
        self.xq = np.empty(width, np.int8)
        self.xd = np.empty(width // GROUP, np.float32)
        self.xs = np.empty(width // 16, np.int32)
        self.xm = np.empty(width // GROUP, np.float32)
        _quantize(x, self.xq, self.xd, self.xs, self.xm)

    def dequantized(self) -> np.ndarray:
        """The values the kernels multiply, as float32 (for tests and error measurements)."""
        return (self.xq.reshape(-1, GROUP).astype(np.float32) * self.xd[:, None]).reshape(-1)


# --- kernels ------------------------------------------------------------------------


_F32 = np.float32


@njit(inline="always")
def _kq_group(kind, acc, data, o, b, g, d, dmin, xq, xd, xm):
    """Group g (a constant, so shifts and scale bytes fold) of a Q4_K / Q5_K block; what it adds outside acc."""
    qs, qh = (o + 16, -1) if kind == _Q4_K else (o + 48, o + 16)
    sc, mn = scale_min_k4(data, o + 4, g)
    at = 8 * b + g
    _dot_kq(data, qs + 32 * (g >> 1), 4 * (g & 1), qh, g, xq, 32 * at, acc, d * _F32(sc) * xd[at])
    return -dmin * _F32(mn) * xm[at]


@njit(inline="always")
def _q6_group(acc, data, o, b, g, d, xq, xd, xs):
    """Group g (a constant) of a Q6_K block: values (q - 32) * d * int8 scale per 16; what it adds outside acc."""
    h, k, at = g >> 2, g & 3, 8 * b + g
    s_lo, s_hi = load_at(data, o + 192 + 2 * g, np.int8), load_at(data, o + 193 + 2 * g, np.int8)
    s = d * xd[at]
    _dot_q6(data, o + 64 * h + 32 * (k & 1), 4 * (k >> 1), o + 128 + 32 * h, 2 * k, xq, 32 * at, acc, s,
            np.intp(s_lo), np.intp(s_hi))
    return _F32(-32) * s * _F32(np.int32(s_lo) * xs[2 * at] + np.int32(s_hi) * xs[2 * at + 1])


@njit(inline="always")
def _block(kind, acc, data, o, b, xq, xd, xs, xm, f16):
    """acc += block b (at byte o) · the activations; returns what the block adds outside acc."""
    if kind == _Q8_0:
        _dot_q8(data, o + 2, xq, 32 * b, acc, fp16_at(f16, data, o) * xd[b])
        return _F32(0)
    if kind == _Q4_0 or kind == _Q4_1:
        s = fp16_at(f16, data, o) * xd[b]
        if kind == _Q4_0:
            _dot_q4(data, o + 2, xq, 32 * b, acc, s)
            return _F32(-8) * fp16_at(f16, data, o) * xm[b]
        _dot_q4(data, o + 4, xq, 32 * b, acc, s)
        return fp16_at(f16, data, o + 2) * xm[b]
    if kind == _Q5_0 or kind == _Q5_1:
        s = fp16_at(f16, data, o) * xd[b]
        if kind == _Q5_0:
            _dot_q5(data, o + 6, load_at(data, o + 2, np.uint32), xq, 32 * b, acc, s)
            return _F32(-16) * fp16_at(f16, data, o) * xm[b]
        _dot_q5(data, o + 8, load_at(data, o + 4, np.uint32), xq, 32 * b, acc, s)
        return fp16_at(f16, data, o + 2) * xm[b]
    if kind == _Q4_K or kind == _Q5_K:
        d, dmin = fp16_at(f16, data, o), fp16_at(f16, data, o + 2)
        return (_kq_group(kind, acc, data, o, b, 0, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 1, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 2, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 3, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 4, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 5, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 6, d, dmin, xq, xd, xm)
                + _kq_group(kind, acc, data, o, b, 7, d, dmin, xq, xd, xm))
    d = fp16_at(f16, data, o + 208)  # Q6_K
    return (_q6_group(acc, data, o, b, 0, d, xq, xd, xs) + _q6_group(acc, data, o, b, 1, d, xq, xd, xs)
            + _q6_group(acc, data, o, b, 2, d, xq, xd, xs) + _q6_group(acc, data, o, b, 3, d, xq, xd, xs)
            + _q6_group(acc, data, o, b, 4, d, xq, xd, xs) + _q6_group(acc, data, o, b, 5, d, xq, xd, xs)
            + _q6_group(acc, data, o, b, 6, d, xq, xd, xs) + _q6_group(acc, data, o, b, 7, d, xq, xd, xs))


def _kernel(kind: int, vb: int, bb: int):
    @kernel_of(GGMLType(kind).name, parallel=True, fastmath={"contract"})
    def mv(data, offs, stride, rows, xq, xd, xs, xm, f16, out, lo, width, nch):
        nblk = width // vb
        rnb = max(nblk * bb, 1)
        for c in prange(nch):
            wide_vectors()
            r0, r1 = chunk_bounds(c, nch, rows)
            acc = _acc8()
            ahead = ahead_rows(kind, rnb)
            for r in range(r0, r1):
                row = row_at(offs, stride, r)
                hint = row_at(offs, stride, r + ahead) if r + ahead < rows else row
                extra = _F32(0)
                for b in range(nblk):
                    hint_block(data, hint, b, bb)
                    extra += _block(kind, acc, data, row + b * bb, b, xq, xd, xs, xm, f16)
                out[0, lo + r] = _acc8_take(acc) + extra

    return mv


_KERNELS = {t: _kernel(int(t), *BLOCK_LAYOUT[t]) for t in sorted(INT8_TYPES)}


def _bound(data, t, offs, stride: int, rows: int, width: int):
    t = as_ggml_type(t)
    if t not in _KERNELS:
        raise UnsupportedError(f"no int8-activation kernel for GGML type {t.name}")
    if not available():
        raise UnsupportedError("int8-activation kernels need a CPU with AVX2")
    mv, offs, data = _KERNELS[t], readonly(offs), readonly(data)

    def run(row: Int8Row, out: np.ndarray, out_lo: int) -> None:
        mv(data, offs, stride, rows, row.xq, row.xd, row.xs, row.xm, F16_TO_F32, out, out_lo, width, thread_chunks(rows))

    return run


_NO_OFFSETS = np.zeros(0, np.int64)


def bound_rows_matmul_int8(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int):
    """As matmul.bound_rows_matmul for one activation row already quantized (an Int8Row): a
    function (row, out, out_lo) writing out[0, out_lo + r] over rows validated by matmul.check_rows."""
    return _bound(data, ggml_type, row_offsets, 0, len(row_offsets), width)


def bound_table_matmul_int8(table: np.ndarray, ggml_type):
    """The same over every row of a C-contiguous (rows, row_nbytes) uint8 table (an output head),
    checked as head.head_logits checks it; rows are addressed by stride, with no offset array
    (it would be 8 bytes of anonymous memory a row)."""
    _, width = check_table(table, ggml_type)
    return _bound(table.reshape(-1), ggml_type, _NO_OFFSETS, table.shape[1], table.shape[0], width)


def warmup(types=None) -> None:
    """Compiles the kernels of `types` (default: every type), or loads them from numba's cache, on tiny inputs."""
    if not available():
        return
    row = Int8Row(np.zeros(256, np.float32))
    for t in _KERNELS:
        if types is not None and t not in types:
            continue
        vb, bb = BLOCK_LAYOUT[t]
        data = np.zeros(256 // vb * bb, np.uint8)
        bound_rows_matmul_int8(data, t, np.zeros(1, np.int64), 256)(row, np.empty((1, 1), np.float32), 0)
