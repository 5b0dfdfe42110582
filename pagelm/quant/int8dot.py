"""The opt-in int8-activation GEMV (weights "mapped-int8"): llama.cpp's scheme, not fp32-exact.

One activation row is quantized once per operator call to int8, round to nearest: in groups of 32
values (a float32 scale each) for the 32-value types, and of 256 (llama.cpp's Q8_K) for the
K-quants. Every 32 weights are multiplied by their 32 int8 activations in integer arithmetic (AVX2
`vpmaddubsw` of unsigned weight values by signed activations, then `vpmaddwd`; where numba compiles for
AVX-512 VNNI, a 32-value block's in one `vpdpbusd`: no pair sum can saturate `vpmaddubsw`, so the int32
lanes are the same). A 32-value block's scales are applied to the eight int32 lanes in float; a K-quant
block's sub-block scales are integers, applied in the `vpmaddwd` (which LLVM fuses with its add to
`vpdpwssd` under VNNI), so that its 256 products are summed exactly in int32 lanes and scaled in float
once a block. Weights whose values are stored with an offset (Q4_0's q - 8, Q6_K's q - 32) or a minimum
(Q4_1, Q5_1, the K-quants) take it through the sums of the quantized activations (per 32 values; per 16
under Q6_K's scales). Vectors are 256-bit under AVX2 and AVX-512 alike, and the bits are the same.
(K-quant sub-blocks taken two at a time in 512-bit vectors, same bits, were tried: 5-11 % less CPU time
on matrices in the caches, but 10 % more on a Llama 3.2 1B q4_k_m decode step, its weights from memory.)
Layers' rows are addressed by offset, an output head's by stride. A call multiplies up to MAX_GEMV_ROWS
activation rows, each quantized alone, reading the weights once: each block is multiplied into every
row's own accumulators in turn, so a row's sums are those of the row multiplied alone, bit for bit
(a batched decode step's and a verify pass's rows, as the float kernels give them).
Kernels read the uint8 array they are handed (normally the read-only file map), never copy it.
"""

import functools

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagelm.errors import UnsupportedError
from pagelm.quant.blockir import I8, I32, V32I8, bytes_at, k4_codes, nibbles16, q5_group
from pagelm.quant.codegen import F16_TO_F32, kernel_of, stack_f32, wide_vectors
from pagelm.quant.head import check_table
from pagelm.quant.matmul import (
    MAX_GEMV_ROWS,
    ahead_rows,
    chunk_bounds,
    thread_chunks,
    fp16_at,
    hint_block,
    load_at,
    row_at,
    readonly,
)
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type

GROUP = 32  # activation values per float32 scale (32-value types)
K_GROUP = 256  # the same for the K-quants

_T = GGMLType
_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1 = int(_T.Q8_0), int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q5_1)
_Q4_K, _Q5_K, _Q6_K = int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)
INT8_TYPES = frozenset(GGMLType(k) for k in (_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q4_K, _Q5_K, _Q6_K))
K_TYPES = frozenset(GGMLType(k) for k in (_Q4_K, _Q5_K, _Q6_K))  # activations in 256-value groups


@functools.cache
def available() -> bool:
    """The kernels use AVX2 instructions directly; elsewhere weights="mapped-int8" is refused. Asked once
    a process: llvmlite reads the host's features anew at each call, and a loader binds an int8 product
    for every row group (thousands in a mixture of experts)."""
    return "+avx2" in llvm.get_host_cpu_features().flatten().split(",")


def _compiled_features() -> set:
    """The CPU features numba compiles for: the host's unless NUMBA_CPU_FEATURES names others (as
    matmul._compiles_avx512 reads them; bench/as_avx2.sh names Haswell's)."""
    return set((numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(","))


# AVX-512 VNNI (with VL): a 32-value block's 32 products summed per 4 into int32 lanes by one vpdpbusd.
VNNI = {"+avx512vl", "+avx512vnni"} <= _compiled_features()


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


def _byte_dot(builder, w, x):
    """<8 x i32>: lane i the sum of w[j] * x[j] over bytes j = 4i..4i+3, w unsigned (<= 128 each), x
    signed (-127..127). Every pair sum fits vpmaddubsw's saturating int16 (2 * 128 * 127 < 2**15),
    so AVX2's two steps and VNNI's one give the same lanes."""
    if VNNI:
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32, ir.Constant(_V8I32, None), w, x)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, w, x)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, pairs, ir.Constant(_V16I16, 1))


def _accumulate(builder, acc, w, x, scale):
    """acc (<8 x float> at pointer acc) += scale * the int32 lanes of _byte_dot(w, x)."""
    lanes = _byte_dot(builder, w, x)
    vec_ptr = builder.bitcast(acc, _V8F32.as_pointer())
    total = builder.fadd(builder.load(vec_ptr, align=4),
                         builder.fmul(builder.sitofp(lanes, _V8F32), _splat(builder, scale, _V8F32)))
    builder.store(total, vec_ptr, align=4)


_ACC = types.CPointer(types.float32)


@intrinsic
def _accs(typingctx):
    """Eight float32 accumulators for each of MAX_GEMV_ROWS rows, on the stack (zeroed)."""

    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, _V8F32, size=MAX_GEMV_ROWS)
        for i in range(MAX_GEMV_ROWS):
            builder.store(ir.Constant(_V8F32, None), builder.gep(ptr, [I32(i)]))
        return builder.bitcast(ptr, ir.FloatType().as_pointer())

    return _ACC(), codegen


@intrinsic
def _acc_of(typingctx, accs, i):
    """Row i's eight accumulators among _accs'."""

    def codegen(context, builder, signature, args):
        return builder.gep(args[0], [builder.mul(args[1], args[1].type(8))])

    return _ACC(accs, i), codegen


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
        _accumulate(builder, args[4], magnitude, signed_x, args[5])
        return context.get_dummy_value()

    return types.void(data, at, xq, xat, acc, scale), codegen


@intrinsic
def _dot_q4(typingctx, data, at, xq, xat, acc, scale):
    """acc += scale * q·x, q the 32 nibbles of the 16 bytes at data[at] (Q4_0, Q4_1 order)."""

    def codegen(context, builder, signature, args):
        w = nibbles16(context, builder, signature.args[0], args[0], args[1])
        x = bytes_at(context, builder, signature.args[2], args[2], args[3])
        _accumulate(builder, args[4], w, x, args[5])
        return context.get_dummy_value()

    return types.void(data, at, xq, xat, acc, scale), codegen


@intrinsic
def _dot_q5(typingctx, data, at, qh, xq, xat, acc, scale):
    """As _dot_q4, each value's fifth bit from bit j of uint32 qh (Q5_0, Q5_1)."""

    def codegen(context, builder, signature, args):
        w = q5_group(context, builder, signature.args[0], args[0], args[1], args[2])
        x = bytes_at(context, builder, signature.args[3], args[3], args[4])
        _accumulate(builder, args[5], w, x, args[6])
        return context.get_dummy_value()

    return types.void(data, at, qh, xq, xat, acc, scale), codegen


def _int16s_at(context, builder, arrty, arr, index, n):
    """n int16 values of an int16 array from element `index`, as an <n x i16> vector."""
    base = context.make_array(arrty)(context, builder, arr).data
    return builder.load(builder.bitcast(builder.gep(base, [index]), ir.VectorType(_I16, n).as_pointer()), align=2)


def _splat_lanes(builder, codes, signed, lanes):
    """A <16 x i16> of codes[lanes[0]] in lanes 0-7 and codes[lanes[1]] in 8-15 (codes: a byte vector)."""
    wide = (builder.sext if signed else builder.zext)(codes, ir.VectorType(_I16, codes.type.count))
    return builder.shuffle_vector(wide, wide, ir.Constant(ir.VectorType(I32, 16), [lanes[0]] * 8 + [lanes[1]] * 8))


@intrinsic
def _dot_k(typingctx, kind, data, o, xq, xat, xs, sat, acc, scale):
    """A K-quant block at data[o] times its 256 activations at xq[xat:]: acc (8 float lanes) += scale
    times the int32 lanes of sum(q · x · s) over its sub-blocks (q unsigned: Q4_K 0-15, Q5_K 0-31,
    Q6_K 0-63 before its -32; s the sub-block's integer scale); returns the int32 its offsets take:
    Q4_K/Q5_K the sum of min g times xs[sat + g] (the sums of x per 32), Q6_K of scale g times
    xs[sat + g] (per 16). `kind` a constant."""
    if not isinstance(kind, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        t, arrty, xty, sty = kind.literal_value, signature.args[1], signature.args[3], signature.args[5]
        data, o, xqa, xat, xsa, sat, accp = args[1], args[2], args[3], args[4], args[5], args[6], args[7]

        def at(base, k):
            return builder.add(base, base.type(k))

        def low(v, shift, bits):
            return _low_bits(builder, v, ir.Constant(ir.IntType(64), shift), bits)

        def weights(q, x_at, scales):  # <8 x i32>: sum(q · x) per pair of bytes, times scales
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, q, bytes_at(context, builder, xty, xqa, x_at))
            return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, pairs, scales)

        lanes = []
        if t == _Q6_K:
            codes = bytes_at(context, builder, arrty, data, at(o, 192), 16)  # int8 scale per 16 values
            for h in range(2):
                ql = [bytes_at(context, builder, arrty, data, at(o, 64 * h + 32 * i)) for i in range(2)]
                top = bytes_at(context, builder, arrty, data, at(o, 128 + 32 * h))
                for k in range(4):
                    q = builder.or_(low(ql[k & 1], 4 * (k >> 1), 4), builder.shl(low(top, 2 * k, 2), _splat8_32(4)))
                    g = 8 * h + 2 * k
                    lanes.append(weights(q, at(xat, 128 * h + 32 * k), _splat_lanes(builder, codes, True, (g, g + 1))))
            offsets = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, builder.sext(codes, _V16I16),
                            _int16s_at(context, builder, sty, xsa, sat, 16))
        else:
            codes, mins = k4_codes(context, builder, arrty, data, at(o, 4))
            qs = at(o, 16 if t == _Q4_K else 48)
            top = None if t == _Q4_K else bytes_at(context, builder, arrty, data, at(o, 16))
            for p in range(4):
                both = bytes_at(context, builder, arrty, data, at(qs, 32 * p))
                for k in range(2):
                    g = 2 * p + k
                    q = low(both, 4 * k, 4)
                    if top is not None:
                        q = builder.or_(q, builder.shl(low(top, g, 1), _splat8_32(4)))
                    lanes.append(weights(q, at(xat, 32 * g), _splat_lanes(builder, codes, False, (g, g))))
            v8i16 = ir.VectorType(_I16, 8)
            offsets = _call(builder, "llvm.x86.sse2.pmadd.wd", ir.VectorType(I32, 4), builder.zext(mins, v8i16),
                            _int16s_at(context, builder, sty, xsa, sat, 8))
        while len(lanes) > 1:  # integers: any order gives the same sum
            lanes = [builder.add(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
        vec_ptr = builder.bitcast(accp, _V8F32.as_pointer())
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F32, [_V8F32] * 3), "llvm.fma.v8f32")
        total = builder.call(fma, [builder.sitofp(lanes[0], _V8F32), _splat(builder, args[8], _V8F32),
                                   builder.load(vec_ptr, align=4)])
        builder.store(total, vec_ptr, align=4)
        return _call(builder, f"llvm.vector.reduce.add.v{offsets.type.count}i32", I32, offsets)

    return types.int32(kind, data, o, xq, xat, xs, sat, acc, scale), codegen


def _splat8_32(value):
    return ir.Constant(V32I8, value)


# --- activations ----------------------------------------------------------------------


@njit(cache=True)
def _quantize_groups(x, group, xq, scales, sums16):
    """x in groups of `group` values to int8 xq, round to nearest, each group's scale amax / 127 into `scales`;
    sums16[i]: the sum of xq's i-th 16 values."""
    for g in range(len(scales)):
        amax = np.float32(0)
        for j in range(group):
            amax = max(amax, abs(x[group * g + j]))
        scales[g] = amax / np.float32(127)
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        for j in range(group):
            xq[group * g + j] = np.int8(np.rint(x[group * g + j] * inv))
    for h in range(len(sums16)):
        s = 0
        for j in range(16):
            s += xq[16 * h + j]
        sums16[h] = s


@njit(cache=True)
def _quantize(x, xq, xd, xs, xm, kq, kd, k16, k32):
    """The 32-value types' activations (xq, xd, xs, xm) and the K-quants' (kq, kd, k16, k32), as Int8Row holds them."""
    _quantize_groups(x, GROUP, xq, xd, xs)
    for g in range(len(xd)):
        xm[g] = xd[g] * np.float32(xs[2 * g] + xs[2 * g + 1])
    _quantize_groups(x, K_GROUP, kq, kd, k16)
    for h in range(len(k32)):
        k32[h] = k16[2 * h] + k16[2 * h + 1]


class Int8Rows:
    """Activation rows (n <= MAX_GEMV_ROWS, width) quantized for the int8 kernels, each alone: for
    the 32-value types values (int8), a float32 scale per 32, the int32 sum of the quantized values
    per 16, and per 32 the sum of the values they stand for; for the K-quants (rows of whole
    256-value groups) values with a scale per 256 and the int16 sums of the quantized values per 16
    and per 32. Row i of each array is activation row i's."""

    __slots__ = ("n", "xq", "xd", "xs", "xm", "kq", "kd", "k16", "k32")

    def __init__(self, x: np.ndarray):
        if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_GEMV_ROWS:
            raise ValueError(f"int8 activations are 1 to {MAX_GEMV_ROWS} rows (n, width), got shape {x.shape}")
        n, width = x.shape
        if width % GROUP:
            raise ValueError(f"an int8 activation row must be a whole number of {GROUP}-value groups, got {width}")
        self.n = n
        self.xq = np.empty((n, width), np.int8)
        self.xd = np.empty((n, width // GROUP), np.float32)
        self.xs = np.empty((n, width // 16), np.int32)
        self.xm = np.empty((n, width // GROUP), np.float32)
        k_width = width if width % K_GROUP == 0 else 0  # no K-quant row is narrower than its 256-value blocks
        self.kq = np.empty((n, k_width), np.int8)
        self.kd = np.empty((n, k_width // K_GROUP), np.float32)
        self.k16 = np.empty((n, k_width // 16), np.int16)
        self.k32 = np.empty((n, k_width // 32), np.int16)
        for i in range(n):
            _quantize(np.ascontiguousarray(x[i], np.float32), self.xq[i], self.xd[i], self.xs[i], self.xm[i],
                      self.kq[i], self.kd[i], self.k16[i], self.k32[i])

    def dequantized(self, ggml_type=None) -> np.ndarray:
        """The values (n, width) the kernels of `ggml_type` (default: the 32-value types') multiply,
        as float32 (for tests and error measurements)."""
        if ggml_type is not None and as_ggml_type(ggml_type) in K_TYPES:
            q, d, group = self.kq, self.kd, K_GROUP
        else:
            q, d, group = self.xq, self.xd, GROUP
        return (q.reshape(self.n, -1, group).astype(np.float32) * d[:, :, None]).reshape(self.n, -1)


# --- kernels ------------------------------------------------------------------------


_F32 = np.float32


@njit(inline="always")
def _block(kind, acc, data, o, b, i, xq, xd, xs, xm, kq, kd, k16, k32, f16):
    """acc += block b (at byte o) · activation row i; returns what the block adds outside acc. (The
    intrinsics read row i of the 2-D activations at its flat offset.)"""
    if kind == _Q8_0:
        _dot_q8(data, o + 2, xq, xq.shape[1] * i + 32 * b, acc, fp16_at(f16, data, o) * xd[i, b])
        return _F32(0)
    if kind == _Q4_0 or kind == _Q4_1:
        s = fp16_at(f16, data, o) * xd[i, b]
        if kind == _Q4_0:
            _dot_q4(data, o + 2, xq, xq.shape[1] * i + 32 * b, acc, s)
            return _F32(-8) * fp16_at(f16, data, o) * xm[i, b]
        _dot_q4(data, o + 4, xq, xq.shape[1] * i + 32 * b, acc, s)
        return fp16_at(f16, data, o + 2) * xm[i, b]
    if kind == _Q5_0 or kind == _Q5_1:
        s = fp16_at(f16, data, o) * xd[i, b]
        if kind == _Q5_0:
            _dot_q5(data, o + 6, load_at(data, o + 2, np.uint32), xq, xq.shape[1] * i + 32 * b, acc, s)
            return _F32(-16) * fp16_at(f16, data, o) * xm[i, b]
        _dot_q5(data, o + 8, load_at(data, o + 4, np.uint32), xq, xq.shape[1] * i + 32 * b, acc, s)
        return fp16_at(f16, data, o + 2) * xm[i, b]
    if kind == _Q4_K or kind == _Q5_K:
        d, dmin = fp16_at(f16, data, o), fp16_at(f16, data, o + 2)
        mins = _dot_k(kind, data, o, kq, kq.shape[1] * i + K_GROUP * b, k32, k32.shape[1] * i + 8 * b, acc,
                      d * kd[i, b])
        return -dmin * kd[i, b] * _F32(mins)
    s = fp16_at(f16, data, o + 208) * kd[i, b]  # Q6_K
    return _F32(-32) * s * _F32(_dot_k(kind, data, o, kq, kq.shape[1] * i + K_GROUP * b, k16,
                                       k16.shape[1] * i + 16 * b, acc, s))


def _kernel(kind: int, vb: int, bb: int):
    @kernel_of(GGMLType(kind).name, parallel=True, fastmath={"contract"})
    def mv(data, offs, stride, rows, n, xq, xd, xs, xm, kq, kd, k16, k32, f16, out, lo, width, nch):
        nblk = width // vb
        rnb = max(nblk * bb, 1)
        for c in prange(nch):
            wide_vectors()
            r0, r1 = chunk_bounds(c, nch, rows)
            accs = _accs()
            extra = carray(stack_f32(MAX_GEMV_ROWS), MAX_GEMV_ROWS)
            ahead = ahead_rows(kind, rnb)
            for r in range(r0, r1):
                row = row_at(offs, stride, r)
                hint = row_at(offs, stride, r + ahead) if r + ahead < rows else row
                if n == 1:  # its sum in a register: through memory, as several rows keep theirs, Q8_0's GEMV slowed most
                    one = _F32(0)
                    for b in range(nblk):
                        hint_block(data, hint, b, bb)
                        one += _block(kind, accs, data, row + b * bb, b, 0, xq, xd, xs, xm, kq, kd, k16, k32, f16)
                    out[0, lo + r] = _acc8_take(accs) + one
                    continue
                for i in range(n):
                    extra[i] = _F32(0)
                for b in range(nblk):
                    hint_block(data, hint, b, bb)
                    for i in range(n):
                        extra[i] += _block(kind, _acc_of(accs, i), data, row + b * bb, b, i, xq, xd, xs, xm, kq, kd,
                                           k16, k32, f16)
                for i in range(n):
                    out[i, lo + r] = _acc8_take(_acc_of(accs, i)) + extra[i]

    return mv


_KERNELS = {t: _kernel(int(t), *BLOCK_LAYOUT[t]) for t in sorted(INT8_TYPES)}


def _bound(data, t, offs, stride: int, rows: int, width: int):
    t = as_ggml_type(t)
    if t not in _KERNELS:
        raise UnsupportedError(f"no int8-activation kernel for GGML type {t.name}")
    if not available():
        raise UnsupportedError("int8-activation kernels need a CPU with AVX2")
    mv, offs, data = _KERNELS[t], readonly(offs), readonly(data)

    def run(x: Int8Rows, out: np.ndarray, out_lo: int) -> None:
        mv(data, offs, stride, rows, x.n, x.xq, x.xd, x.xs, x.xm, x.kq, x.kd, x.k16, x.k32, F16_TO_F32, out, out_lo,
           width, thread_chunks(rows))

    return run


_NO_OFFSETS = np.zeros(0, np.int64)


def bound_rows_matmul_int8(data: np.ndarray, ggml_type, row_offsets: np.ndarray, width: int):
    """As matmul.bound_rows_matmul for activation rows already quantized (an Int8Rows of n): a
    function (rows, out, out_lo) writing out[:n, out_lo + r] over rows validated by matmul.check_rows."""
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
    row = Int8Rows(np.zeros((1, 256), np.float32))
    for t in _KERNELS:
        if types is not None and t not in types:
            continue
        vb, bb = BLOCK_LAYOUT[t]
        data = np.zeros(256 // vb * bb, np.uint8)
        bound_rows_matmul_int8(data, t, np.zeros(1, np.int64), 256)(row, np.empty((1, 1), np.float32), 0)
