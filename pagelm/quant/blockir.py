"""LLVM IR for a block's values as byte vectors, shared by the numba intrinsics of the kernels
(matmul, int8dot, the head): byte loads, nibble pairs, Q5's fifth bits, a Q4_K/Q5_K block's packed
6-bit scales (matmul), and a Q6_K block's 256 values and 16 scales (head, matmul).

Builds IR only (no numba functions), so each kernel module's cache stays keyed by its own source.
"""

import contextlib

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagelm.quant.codecs import MXFP4_VALUES

I8, I32 = ir.IntType(8), ir.IntType(32)
V32I8 = ir.VectorType(I8, 32)
_V8I8 = ir.VectorType(I8, 8)


def bytes_at(context, builder, arrty, arr, offset, n=32):
    """n bytes of a uint8/int8 array from byte `offset`, as an <n x i8> vector (unaligned load)."""
    base = context.make_array(arrty)(context, builder, arr).data
    ptr = builder.gep(builder.bitcast(base, I8.as_pointer()), [offset])
    return builder.load(builder.bitcast(ptr, ir.VectorType(I8, n).as_pointer()), align=1)


def nibbles16(context, builder, arrty, arr, at):
    """32 values from the 16 bytes at `at`: the low nibbles, then the high nibbles."""
    b = bytes_at(context, builder, arrty, arr, at, 16)
    both = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(I32, 32), list(range(16)) * 2))
    shifts = ir.Constant(V32I8, [0] * 16 + [4] * 16)
    return builder.and_(builder.lshr(both, shifts), ir.Constant(V32I8, 15))


def _bits32(builder, word):
    """Bit j of uint32 `word` as 16 or 0 in byte j (the fifth bit of a Q5_0/Q5_1 value)."""
    b = builder.bitcast(word, ir.VectorType(I8, 4))
    spread = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(I32, 32), [j // 8 for j in range(32)]))
    mask = ir.Constant(V32I8, [1 << (j % 8) for j in range(32)])
    isset = builder.icmp_unsigned("!=", builder.and_(spread, mask), ir.Constant(V32I8, 0))
    return builder.select(isset, ir.Constant(V32I8, 16), ir.Constant(V32I8, 0))


def q5_group(context, builder, arrty, arr, qs, qh_word):
    """The 32 values (0..31) of a Q5_0/Q5_1 block: nibbles of the 16 bytes at `qs`, fifth bits from uint32 qh_word."""
    return builder.or_(nibbles16(context, builder, arrty, arr, qs), _bits32(builder, qh_word))


@intrinsic
def stack_bytes(typingctx, n):
    """n (a constant) bytes on the stack, uninitialised."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(cgutils.alloca_once(builder, ir.VectorType(I8, n.literal_value)), I8.as_pointer())

    return types.CPointer(types.uint8)(n), codegen


@intrinsic
def q5_values(typingctx, data, qs, qh, buf):
    """buf[j] = value j (0..31) of a Q5_0/Q5_1 block: the nibble from the 16 bytes at data[qs]
    (low nibbles first), the fifth bit from bit j of uint32 qh. Four byte ops in place of a
    variable shift and a pack per 8 values."""

    def codegen(context, builder, signature, args):
        values = q5_group(context, builder, signature.args[0], args[0], args[1], args[2])
        builder.store(values, builder.bitcast(args[3], V32I8.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(data, qs, qh, buf), codegen


def _lanes8(values):
    """An <8 x i8> constant: the first value in lanes 0-3 (groups 0-3), the second in lanes 4-7."""
    return ir.Constant(_V8I8, [values[0]] * 4 + [values[1]] * 4)


def k4_codes(context, builder, arrty, data, at):
    """(scales, mins): the 6-bit scale and min of each of the 8 groups of a Q4_K/Q5_K block whose 12
    packed scale bytes start at data[at], as two <8 x i8> vectors (matmul.scale_min_k4 of every group).

    Groups 0-3: scale = S[g] & 63, min = S[g + 4] & 63; groups 4-7: scale = S[g + 4] & 15 | (S[g - 4] >> 6) << 4,
    min = S[g + 4] >> 4 | (S[g] >> 6) << 4.
    """
    s = bytes_at(context, builder, arrty, data, at, 12)

    def pick(first, second):
        return builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(I32, 8), first + second))

    def tops(v):  # (v >> 6) << 4 in groups 4-7, 0 in groups 0-3
        return builder.and_(builder.shl(builder.lshr(v, _lanes8((6, 6))), _lanes8((4, 4))), _lanes8((0, 48)))

    low = pick([0, 1, 2, 3], [8, 9, 10, 11])  # S[g], then S[g + 4]
    scale = builder.or_(builder.and_(low, _lanes8((63, 15))), tops(pick([0, 1, 2, 3], [0, 1, 2, 3])))
    high = pick([4, 5, 6, 7], [8, 9, 10, 11])  # S[g + 4]
    first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
    mins = builder.select(first, builder.and_(high, _lanes8((63, 63))), builder.lshr(high, _lanes8((4, 4))))
    return scale, builder.or_(mins, tops(pick([4, 5, 6, 7], [4, 5, 6, 7])))


@intrinsic
def k4_scales(typingctx, data, at, d, dmin, buf):
    """buf[g] = d · scale g and buf[8 + g] = dmin · min g for the 8 groups of a Q4_K/Q5_K block whose
    12 packed 6-bit scale bytes start at data[at]: the values of matmul.scale_min_k4 for every group
    at once (k4_codes), in a few byte-vector ops instead of ~12 scalar ones a group."""

    def codegen(context, builder, signature, args):
        scale, mins = k4_codes(context, builder, signature.args[0], args[0], args[1])
        v8f = ir.VectorType(ir.FloatType(), 8)
        out = builder.bitcast(args[4], v8f.as_pointer())
        for i, (codes, factor) in enumerate(((scale, args[2]), (mins, args[3]))):
            splat = builder.insert_element(ir.Constant(v8f, ir.Undefined), factor, I32(0))
            splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(I32, 8), [0] * 8))
            values = builder.fmul(splat, builder.uitofp(codes, v8f))
            builder.store(values, builder.gep(out, [I32(i)]), align=4)
        return context.get_dummy_value()

    return types.void(data, at, d, dmin, buf), codegen


_V64I8 = ir.VectorType(I8, 64)


@intrinsic
def q4k_floats(typingctx, data, at, scales, w):
    """w[n] = the value n < 256 of the Q4_K block at data[at], as float32: q · scale - min of its
    group, with the 8 scales then the 8 mins at `scales` (a float32 pointer, k4_scales' values).
    AVX-512 only: each group's 16 possible values are one vector, fma(0..15, scale, -min), from which
    each value is picked by its nibble (vpermps reads the low 4 bits of each index), off the FMA
    pipes' int-to-float work. q · scale is exact in float32 (4 bits times an 11-bit half times a
    6-bit scale), so this is q · scale - min with one rounding or two, the same bits either way.
    (The same for Q5_K, 32 values from two vectors by vpermi2ps, was no faster.)"""

    def codegen(context, builder, signature, args):
        arrty, data, at, sp = signature.args[0], args[0], args[1], args[2]
        v16i = ir.VectorType(I32, 16)
        pick, fma, iota = _permvar16(builder), fma16(builder), _iota16()

        def table(g):
            scale = splat_f32(builder, builder.load(builder.gep(sp, [I32(g)])))
            low = splat_f32(builder, builder.fneg(builder.load(builder.gep(sp, [I32(8 + g)]))))
            return builder.call(fma, [iota, scale, low])

        for p in range(4):  # groups 2p and 2p + 1: the low and high nibbles of 32 bytes
            quants = bytes_at(context, builder, arrty, data, builder.add(at, at.type(16 + 32 * p)), 32)
            tables = table(2 * p), table(2 * p + 1)
            for h in range(2):
                index = builder.zext(
                    builder.shuffle_vector(quants, quants, ir.Constant(v16i, list(range(16 * h, 16 * h + 16)))), v16i)
                for k, nibble in enumerate((index, builder.lshr(index, ir.Constant(v16i, [4] * 16)))):
                    builder.store(builder.call(pick, [tables[k], nibble]), vector_at(builder, args[3], 4 * p + 2 * k + h),
                                  align=4)
        return context.get_dummy_value()

    return types.void(data, at, scales, w), codegen


def _permvar16(builder):
    """vpermps: lane l of the result is lane (index l & 15) of the table (AVX-512)."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F, [_V16F, ir.VectorType(I32, 16)]), "llvm.x86.avx512.permvar.sf.512")


def fma16(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")


def _iota16(offset=0):
    return ir.Constant(_V16F, [float(q + offset) for q in range(16)])


def _splat8(n, value):
    return ir.Constant(ir.VectorType(I8, n), [value] * n)


@intrinsic
def q6k_values(typingctx, data, at, buf):
    """buf[n] = value n (-32..31, as int8 bits) of the Q6_K block at data[at], n < 256, in 64-byte vector ops.

    Half h (values 128h..128h+127) has low bytes L = ql[64h : 64h + 64] and 32 top bytes T = qh[32h : 32h + 32].
    With T2 = T, then T >> 2 (64 bytes): value 128h + i is L[i] & 15 | (T2[i] & 3) << 4, and value
    128h + 64 + i is L[i] >> 4 | (T2[i] >> 4 & 3) << 4, each minus 32 (i < 64).
    """

    def codegen(context, builder, signature, args):
        arrty, data, at = signature.args[0], args[0], args[1]
        out = builder.bitcast(args[2], _V64I8.as_pointer())
        for h in range(2):
            low = bytes_at(context, builder, arrty, data, builder.add(at, at.type(64 * h)), 64)
            top = bytes_at(context, builder, arrty, data, builder.add(at, at.type(128 + 32 * h)), 32)
            tops = builder.shuffle_vector(
                top, builder.lshr(top, _splat8(32, 2)), ir.Constant(ir.VectorType(I32, 64), list(range(64)))
            )
            first = builder.or_(
                builder.and_(low, _splat8(64, 15)), builder.and_(builder.shl(tops, _splat8(64, 4)), _splat8(64, 48))
            )
            second = builder.or_(builder.lshr(low, _splat8(64, 4)), builder.and_(tops, _splat8(64, 48)))
            for i, half in enumerate((first, second)):
                builder.store(builder.sub(half, _splat8(64, 32)), builder.gep(out, [I32(2 * h + i)]), align=1)
        return context.get_dummy_value()

    return types.void(data, at, buf), codegen


@intrinsic
def q6k_scales16(typingctx, data, at, d, buf):
    """buf[g] = d · int8 scale g for the 16 scale bytes at data[at] (a Q6_K block's, 16 values each)."""

    def codegen(context, builder, signature, args):
        v16f = ir.VectorType(ir.FloatType(), 16)
        codes = bytes_at(context, builder, signature.args[0], args[0], args[1], 16)
        splat = builder.insert_element(ir.Constant(v16f, ir.Undefined), args[2], I32(0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(I32, 16), [0] * 16))
        values = builder.fmul(splat, builder.sitofp(codes, v16f))
        builder.store(values, builder.bitcast(args[3], v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(data, at, d, buf), codegen


# --- accumulators of several activation rows, kept in vector registers ----------------------
#
# A GEMV over several activation rows unpacks each block of W once into float32 values w and fuses
# them into every row's accumulators: row i owns `vectors` <16 x float> accumulators, lane l of
# which sums w[l] · x[i, l] over the blocks in order, then a fixed tree sums its lanes. Each row's
# arithmetic is thus the same whatever the other rows are. The accumulators live in an alloca that
# is only ever read and written as whole vectors at constant positions, so LLVM keeps them in registers.

_F32 = ir.FloatType()
_V16F = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(I8, 16)


def vector_at(builder, ptr, k):
    """The k-th <16 x float> at float pointer ptr (as a pointer)."""
    return builder.gep(builder.bitcast(ptr, _V16F.as_pointer()), [I32(k)])


def splat_f32(builder, value):
    v = builder.insert_element(ir.Constant(_V16F, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), [0] * 16))


def _literals(*ns):
    return all(isinstance(n, types.IntegerLiteral) for n in ns)


@intrinsic
def acc_vectors(typingctx, n):
    """n (a constant) <16 x float> accumulators on the stack, as a float32 pointer."""
    if not _literals(n):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(cgutils.alloca_once(builder, _V16F, size=n.literal_value), _F32.as_pointer())

    return types.CPointer(types.float32)(n), codegen


@intrinsic
def acc_zero(typingctx, acc, rows, vectors):
    """Zeroes the rows · vectors accumulators (constants)."""
    if not _literals(rows, vectors):
        return None

    def codegen(context, builder, signature, args):
        for k in range(rows.literal_value * vectors.literal_value):
            builder.store(ir.Constant(_V16F, None), vector_at(builder, args[0], k))
        return context.get_dummy_value()

    return types.void(acc, rows, vectors), codegen


@intrinsic
def fma_rows(typingctx, acc, w, acc2, w2, pair, x, i0, end, width, xo, rows, vectors, runs):
    """For each of `runs` runs r of 16 · vectors values, then i < rows with i0 + i < end and v < vectors
    (constants): accumulator i · vectors + v = fma(w[16 (r · vectors + v) :][:16], x[i0 + i, xo + 16
    (r · vectors + v) :][:16], itself), and when pair (a constant) is 2 the same of acc2 with w2 (a
    second row of W): each vector of x is loaded once for both. A block of 256 values is 8 runs of 32
    into the same 2 vectors of a row. Rows past end - 1 are skipped where a block is one run, else they
    repeat the last (computed, never stored: 8 runs' branches took Q4_K's 4-row passes 1.5-1.9x the
    time). x is a 2-D float32 array (rows strided; width unused), or 1-D: the rows of x, width values each, in
    groups (rows i0..end the one passed), each group's rows interleaved 32 values at a time
    (matmul.interleaved; one run a block)."""
    if not _literals(pair, rows, vectors, runs):
        return None

    def codegen(context, builder, signature, args):
        accp, wp, accp2, wp2, _, xa, i0v, endv, widthv, xov = args[:10]
        arr = context.make_array(signature.args[5])(context, builder, xa)
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        fma = fma16(builder)
        count = vectors.literal_value
        if signature.args[5].ndim == 2:
            stride, col = cgutils.unpack_tuple(builder, arr.strides, 2)[0], builder.mul(xov, xov.type(4))
        else:  # row i0 + i's 32 values from xo at 4 i0 width + 128 ((end - i0) xo / 32 + i)
            group = builder.sub(endv, i0v)
            col = builder.add(builder.mul(builder.mul(i0v, widthv), i0v.type(4)),
                              builder.mul(builder.mul(builder.sdiv(xov, xov.type(32)), group), xov.type(128)))
            stride, col = xov.type(128), builder.sub(col, builder.mul(i0v, i0v.type(128)))
        starts, present = [], []
        for i in range(rows.literal_value):
            row = builder.add(i0v, i0v.type(i))
            present.append(builder.icmp_signed("<", row, endv))
            if runs.literal_value > 1:
                row = builder.select(present[-1], row, builder.sub(endv, endv.type(1)))
            starts.append(builder.add(builder.mul(row, stride), col))
        for r in range(runs.literal_value):
            first = r * count
            weights = [(accp, [builder.load(vector_at(builder, wp, first + v), align=4) for v in range(count)])]
            if pair.literal_value == 2:
                weights.append((accp2, [builder.load(vector_at(builder, wp2, first + v), align=4) for v in range(count)]))
            for i, at in enumerate(starts):
                with builder.if_then(present[i]) if i and runs.literal_value == 1 else contextlib.nullcontext():
                    for v in range(count):
                        offset = builder.add(at, at.type(64 * (first + v)))
                        xv = builder.load(builder.bitcast(builder.gep(base, [offset]), _V16F.as_pointer()), align=4)
                        for accs, ws in weights:
                            ap = vector_at(builder, accs, i * count + v)
                            builder.store(builder.call(fma, [ws[v], xv, builder.load(ap)]), ap)
        return context.get_dummy_value()

    return types.void(acc, w, acc2, w2, pair, x, i0, end, width, xo, rows, vectors, runs), codegen


def _lane_sum(builder, vs):
    """The lanes of <16 x float> vectors vs (a power of two of them) summed as one tree: the lower
    half of the lanes plus the upper half, recursively, in vector adds (loops over the lanes compiled
    to stack round trips and a jump table, ~25 ns a row of a Q6_K head)."""
    while len(vs) > 1:
        half = len(vs) // 2
        vs = [builder.fadd(vs[k], vs[k + half]) for k in range(half)]
    v, w = vs[0], 16
    while w > 1:
        w //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, w), list(range(w))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, w), list(range(w, 2 * w))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, I32(0))


@intrinsic
def acc_store(typingctx, acc, rows, vectors, out, i0, n, col):
    """out[i0 + i, col] = the lane sum (_lane_sum) of row i's accumulators, for i < rows (constants)
    with i0 + i < n; out a C-contiguous 2-D float32 array."""
    if not _literals(rows, vectors):
        return None

    def codegen(context, builder, signature, args):
        accp, _, _, outa, i0v, nv, colv = args
        arr = context.make_array(signature.args[3])(context, builder, outa)
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        count = vectors.literal_value
        for i in range(rows.literal_value):
            row = builder.add(i0v, i0v.type(i))
            with builder.if_then(builder.icmp_signed("<", row, nv)):
                total = _lane_sum(builder, [builder.load(vector_at(builder, accp, i * count + k)) for k in range(count)])
                at = builder.add(builder.mul(row, stride), builder.mul(colv, colv.type(4)))
                builder.store(total, builder.bitcast(builder.gep(base, [at]), _F32.as_pointer()))
        return context.get_dummy_value()

    return types.void(acc, rows, vectors, out, i0, n, col), codegen


# GGML type numbers of the 32-value layouts values32 unpacks (as pagelm.quant.types.GGMLType).
_F32_T, _F16_T, _Q4_0_T, _Q4_1_T, _Q5_0_T, _Q5_1_T, _Q8_0_T, _BF16_T, _MXFP4_T = 0, 1, 2, 3, 6, 7, 8, 30, 39
_V32F = ir.VectorType(_F32, 32)


def _splat32(builder, value):
    v = builder.insert_element(ir.Constant(_V32F, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 32), [0] * 32))


@intrinsic
def values32(typingctx, kind, data, at, qh, d, m, w):
    """w[0:32] = the 32 values of a block of GGML type `kind` (a constant) as float32, decode_f32's
    (q · d, then + m where the type has one): quants from data[at:] (Q5's fifth bits from uint32 qh),
    or the 32 stored values of a float type from data[at:]."""
    if not _literals(kind):
        return None

    def codegen(context, builder, signature, args):
        t, arrty = kind.literal_value, signature.args[1]
        data, at, qh, d, m = args[1], args[2], args[3], args[4], args[5]
        base = builder.gep(builder.bitcast(context.make_array(arrty)(context, builder, data).data, I8.as_pointer()), [at])
        if t == _F32_T:
            values = builder.load(builder.bitcast(base, _V32F.as_pointer()), align=1)
        elif t == _F16_T:
            halves = builder.load(builder.bitcast(base, ir.VectorType(ir.HalfType(), 32).as_pointer()), align=1)
            values = builder.fpext(halves, _V32F)
        elif t == _BF16_T:
            bits = builder.load(builder.bitcast(base, ir.VectorType(ir.IntType(16), 32).as_pointer()), align=1)
            wide = builder.shl(builder.zext(bits, ir.VectorType(I32, 32)), ir.Constant(ir.VectorType(I32, 32), 16))
            values = builder.bitcast(wide, _V32F)
        else:
            if t == _Q8_0_T:
                q, signed = bytes_at(context, builder, arrty, data, at), True
            elif t in (_Q4_0_T, _Q4_1_T):
                q, signed = nibbles16(context, builder, arrty, data, at), t == _Q4_0_T
            elif t == _MXFP4_T:
                q, signed = _mxfp4_codes(builder, nibbles16(context, builder, arrty, data, at)), True
            else:
                q, signed = q5_group(context, builder, arrty, data, at, qh), t == _Q5_0_T
            if t == _Q4_0_T:
                q = builder.sub(q, _splat8(32, 8))
            elif t == _Q5_0_T:
                q = builder.sub(q, _splat8(32, 16))
            values = builder.fmul((builder.sitofp if signed else builder.uitofp)(q, _V32F), _splat32(builder, d))
            if t in (_Q4_1_T, _Q5_1_T):
                values = builder.fadd(values, _splat32(builder, m))
        builder.store(values, builder.bitcast(args[6], _V32F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(kind, data, at, qh, d, m, w), codegen


def _mxfp4_codes(builder, q):
    """MXFP4's code of each 4-bit value of byte vector q: its magnitude from the low 3 bits (0-4 as
    they are, 5 -> 6, 6 -> 8, 7 -> 12), negative where bit 3 is set."""
    n = q.type.count
    low = builder.and_(q, _splat8(n, 7))

    def plus(where, add):
        return builder.select(builder.icmp_unsigned("==", low, _splat8(n, where)), _splat8(n, add), _splat8(n, 0))

    magnitude = builder.add(builder.add(builder.add(low, plus(5, 1)), plus(6, 2)), plus(7, 5))
    negative = builder.icmp_unsigned("!=", builder.and_(q, _splat8(n, 8)), _splat8(n, 0))
    return builder.select(negative, builder.sub(_splat8(n, 0), magnitude), magnitude)


@intrinsic
def q4_floats(typingctx, kind, data, at, d, m, w):
    """w[0:32] = values32's values of the Q4_0 / Q4_1 / MXFP4 block (`kind`, a constant) whose 16
    quant bytes start at data[at], each picked by its nibble from the block's 16 possible floats
    (AVX-512 vpermps, which reads the low 4 bits of each index): (q - 8) · d, fma(q, d, m), the bits
    of q · d + m since q · d is exact in float32 (4 bits times an 11-bit half), or code(q) · d."""
    if not _literals(kind):
        return None

    def codegen(context, builder, signature, args):
        t, arrty, (data, at, d, m) = kind.literal_value, signature.args[1], args[1:5]
        v16i = ir.VectorType(I32, 16)
        if t == _Q4_0_T:
            table = builder.fmul(_iota16(-8), splat_f32(builder, d))
        elif t == _MXFP4_T:
            table = builder.fmul(ir.Constant(_V16F, [float(c) for c in MXFP4_VALUES]), splat_f32(builder, d))
        else:
            table = builder.call(fma16(builder), [_iota16(), splat_f32(builder, d), splat_f32(builder, m)])
        index, pick = builder.zext(bytes_at(context, builder, arrty, data, at, 16), v16i), _permvar16(builder)
        for h, nibble in enumerate((index, builder.lshr(index, ir.Constant(v16i, [4] * 16)))):
            builder.store(builder.call(pick, [table, nibble]), vector_at(builder, args[5], h), align=4)
        return context.get_dummy_value()

    return types.void(kind, data, at, d, m, w), codegen


def _permvar32(builder):
    """vpermi2ps: lane l of the result is lane (index l & 31) of the two tables, the first's lanes 0-15."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F, [_V16F, ir.VectorType(I32, 16), _V16F]),
        "llvm.x86.avx512.vpermi2var.ps.512")


@intrinsic
def q5_floats(typingctx, kind, data, at, qh, d, m, w):
    """w[0:32] = values32's values of the Q5_0 / Q5_1 block (`kind`, a constant) whose 16 quant
    bytes start at data[at] and whose fifth bits are uint32 qh, each picked by its 5 bits from the
    block's 32 possible floats (AVX-512 vpermi2ps, which reads the low 5 bits of each index; the
    fifth bit set through a mask of qh's bits): (q - 16) · d, or fma(q, d, m), the bits of q · d + m
    since q · d is exact in float32 (5 bits times an 11-bit half)."""
    if not _literals(kind):
        return None

    def codegen(context, builder, signature, args):
        t, arrty, (data, at, qh, d, m) = kind.literal_value, signature.args[1], args[1:6]
        v16i, mask16 = ir.VectorType(I32, 16), ir.VectorType(ir.IntType(1), 16)
        if t == _Q5_0_T:
            tables = [builder.fmul(_iota16(offset), splat_f32(builder, d)) for offset in (-16, 0)]
        else:
            tables = [builder.call(fma16(builder), [_iota16(offset), splat_f32(builder, d), splat_f32(builder, m)])
                      for offset in (0, 16)]
        index = builder.zext(bytes_at(context, builder, arrty, data, at, 16), v16i)
        nibbles = (builder.and_(index, ir.Constant(v16i, [15] * 16)), builder.lshr(index, ir.Constant(v16i, [4] * 16)))
        pick = _permvar32(builder)
        for h, nibble in enumerate(nibbles):
            fifth = builder.bitcast(builder.trunc(builder.lshr(qh, qh.type(16 * h)), ir.IntType(16)), mask16)
            full = builder.select(fifth, builder.or_(nibble, ir.Constant(v16i, [16] * 16)), nibble)
            builder.store(builder.call(pick, [tables[0], full, tables[1]]), vector_at(builder, args[6], h), align=4)
        return context.get_dummy_value()

    return types.void(kind, data, at, qh, d, m, w), codegen


@intrinsic
def q6k_floats(typingctx, values, scales, w):
    """w[16g + j] = int8 values[16g + j] · scales[g] for g < 16, j < 16 (a Q6_K block's 256 values
    from q6k_values and q6k_scales16)."""

    def codegen(context, builder, signature, args):
        q = builder.bitcast(args[0], _V16I8.as_pointer())
        for g in range(16):
            s = builder.load(builder.gep(args[1], [I32(g)]))
            v = builder.sitofp(builder.load(builder.gep(q, [I32(g)]), align=1), _V16F)
            builder.store(builder.fmul(v, splat_f32(builder, s)), vector_at(builder, args[2], g), align=4)
        return context.get_dummy_value()

    return types.void(values, scales, w), codegen
