"""LLVM IR for the values of a 32-value group as one <32 x i8> vector, shared by the numba intrinsics
of the matmul kernels (matmul, int8dot): byte loads, nibble pairs, Q5's fifth bits.

Builds IR only (no numba functions), so each kernel module's cache stays keyed by its own source.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V32I8 = ir.VectorType(_I8, 32)


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
