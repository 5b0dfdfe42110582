"""LLVM IR for the values of a 32-value group as one <32 x i8> vector, shared by the numba intrinsics
of the matmul kernels (matmul, int8dot): byte loads, nibble pairs, Q5's fifth bits, and a
Q4_K/Q5_K block's packed 6-bit scales (matmul).

Builds IR only (no numba functions), so each kernel module's cache stays keyed by its own source.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V32I8 = ir.VectorType(_I8, 32)
_V8I8 = ir.VectorType(_I8, 8)


def _bytes_at(context, builder, arrty, arr, offset, n=32):
    """n bytes of a uint8/int8 array from byte `offset`, as an <n x i8> vector (unaligned load)."""
    base = context.make_array(arrty)(context, builder, arr).data
    ptr = builder.gep(builder.bitcast(base, _I8.as_pointer()), [offset])
    return builder.load(builder.bitcast(ptr, ir.VectorType(_I8, n).as_pointer()), align=1)


def _nibbles16(context, builder, arrty, arr, at):
    """32 values from the 16 bytes at `at`: the low nibbles, then the high nibbles."""
    b = _bytes_at(context, builder, arrty, arr, at, 16)
    both = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
    shifts = ir.Constant(_V32I8, [0] * 16 + [4] * 16)
    return builder.and_(builder.lshr(both, shifts), ir.Constant(_V32I8, 15))


def _bits32(builder, word):
    """Bit j of uint32 `word` as 16 or 0 in byte j (the fifth bit of a Q5_0/Q5_1 value)."""
    b = builder.bitcast(word, ir.VectorType(_I8, 4))
    spread = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
    mask = ir.Constant(_V32I8, [1 << (j % 8) for j in range(32)])
    isset = builder.icmp_unsigned("!=", builder.and_(spread, mask), ir.Constant(_V32I8, 0))
    return builder.select(isset, ir.Constant(_V32I8, 16), ir.Constant(_V32I8, 0))


def _q5_group(context, builder, arrty, arr, qs, qh_word):
    """The 32 values (0..31) of a Q5_0/Q5_1 block: nibbles of the 16 bytes at `qs`, fifth bits from uint32 qh_word."""
    return builder.or_(_nibbles16(context, builder, arrty, arr, qs), _bits32(builder, qh_word))


@intrinsic
def _stack_u8x32(typingctx):
    """32 bytes on the stack (uninitialised)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(cgutils.alloca_once(builder, _V32I8), _I8.as_pointer())

    return types.CPointer(types.uint8)(), codegen


@intrinsic
def _q5_values(typingctx, data, qs, qh, buf):
    """buf[j] = value j (0..31) of a Q5_0/Q5_1 block: the nibble from the 16 bytes at data[qs]
    (low nibbles first), the fifth bit from bit j of uint32 qh. Four byte ops in place of a
    variable shift and a pack per 8 values."""

    def codegen(context, builder, signature, args):
        values = _q5_group(context, builder, signature.args[0], args[0], args[1], args[2])
        builder.store(values, builder.bitcast(args[3], _V32I8.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(data, qs, qh, buf), codegen


def _lanes8(values):
    """An <8 x i8> constant: the first value in lanes 0-3 (groups 0-3), the second in lanes 4-7."""
    return ir.Constant(_V8I8, [values[0]] * 4 + [values[1]] * 4)


@intrinsic
def _k4_scales(typingctx, data, at, d, dmin, buf):
    """buf[g] = d · scale g and buf[8 + g] = dmin · min g for the 8 groups of a Q4_K/Q5_K block whose
    12 packed 6-bit scale bytes start at data[at]: the values of matmul._scale_min_k4 for every group
    at once, in a few byte-vector ops instead of ~12 scalar ones a group.

    Groups 0-3: scale = S[g] & 63, min = S[g + 4] & 63; groups 4-7: scale = S[g + 4] & 15 | (S[g - 4] >> 6) << 4,
    min = S[g + 4] >> 4 | (S[g] >> 6) << 4.
    """

    def codegen(context, builder, signature, args):
        s = _bytes_at(context, builder, signature.args[0], args[0], args[1], 12)

        def pick(first, second):
            return builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(_I32, 8), first + second))

        def tops(v):  # (v >> 6) << 4 in groups 4-7, 0 in groups 0-3
            return builder.and_(builder.shl(builder.lshr(v, _lanes8((6, 6))), _lanes8((4, 4))), _lanes8((0, 48)))

        low = pick([0, 1, 2, 3], [8, 9, 10, 11])  # S[g], then S[g + 4]
        scale = builder.or_(builder.and_(low, _lanes8((63, 15))), tops(pick([0, 1, 2, 3], [0, 1, 2, 3])))
        high = pick([4, 5, 6, 7], [8, 9, 10, 11])  # S[g + 4]
        first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
        mins = builder.select(first, builder.and_(high, _lanes8((63, 63))), builder.lshr(high, _lanes8((4, 4))))
        mins = builder.or_(mins, tops(pick([4, 5, 6, 7], [4, 5, 6, 7])))
        v8f = ir.VectorType(ir.FloatType(), 8)
        out = builder.bitcast(args[4], v8f.as_pointer())
        for i, (codes, factor) in enumerate(((scale, args[2]), (mins, args[3]))):
            splat = builder.insert_element(ir.Constant(v8f, ir.Undefined), factor, _I32(0))
            splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
            values = builder.fmul(splat, builder.uitofp(codes, v8f))
            builder.store(values, builder.gep(out, [_I32(i)]), align=4)
        return context.get_dummy_value()

    return types.void(data, at, d, dmin, buf), codegen
