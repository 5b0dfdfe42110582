"""Code generation helpers the numba kernels share: the decorator of per-type kernels, function
attributes, prefetch hints, stack buffers kept in registers, and the fp16 table. No kernel of its own.
Every kernel module imports it, so it is where reading numba's cache is made to survive damaged entries,
and numba's inlining made to copy each inlined function once (runtime.numba_inline)."""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagelm.runtime import kernel_cache, numba_inline

kernel_cache.tolerate_damaged_entries()
numba_inline.copy_scopes_once()


def kernel_of(name: str, **options):
    """njit(cache=True, **options) for a kernel a factory makes once per block type (or tile kind), named
    after `name` (its __qualname__ gets "_name"). Each type's kernel is a closure of the same code and
    name, and numba names compiled symbols by the function's name and a per-process counter: two types
    compiled in two processes could get the same symbol, and a process that loaded both from numba's
    cache then found one type's code at the other's address (numba looks a first-class function's and
    a dispatcher's entry up by symbol name): a Gemma 3 decode after a SmolLM2 process had filled the
    cache gave NaN logits. Named per type, each also keeps a cache index of its own."""

    def wrap(fn):
        fn.__qualname__, fn.__name__ = f"{fn.__qualname__}_{name}", f"{fn.__name__}_{name}"
        return njit(cache=True, **options)(fn)

    return wrap


# fp16 bits -> float32, exactly as numpy converts (the same conversion decode_* uses).
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
F16_TO_F32.flags.writeable = False


@intrinsic
def wide_vectors(typingctx):
    """Lets LLVM vectorize the calling function with 512-bit registers.

    LLVM's tuning for AVX-512 cores prefers 256-bit vectors. This sets the function attribute
    that overrides it for one function, so no environment variable (which numba would only read
    at its import) is involved and import order does not matter. Call it inside each prange
    body: parfors compile the body as a function of its own.
    """

    def codegen(context, builder, signature, args):
        # llvmlite only accepts its list of known attributes; string attributes are valid IR.
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def prefetch(typingctx, array, offset):
    """Hints the cache line at byte `offset` of `array`'s data into cache; never faults."""

    def codegen(context, builder, signature, args):
        data = context.make_array(array)(context, builder, args[0]).data
        ptr = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.void(array, types.intp), codegen


@intrinsic
def keep_loops(typingctx):
    """Marks the calling function optsize, so LLVM does not fully unroll its small fixed loops
    before the loop vectorizer sees them (numba runs no SLP vectorizer). Call it in each prange body."""

    def codegen(context, builder, signature, args):
        builder.function.attributes.add("optsize")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def stack_f32(typingctx, n):
    """n (a constant) float32 on the stack: unlike a heap array, LLVM can keep them in registers."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=n.literal_value)

    return types.CPointer(types.float32)(n), codegen


@intrinsic
def opaque(typingctx, ptr):
    """`ptr` through an empty asm statement. LLVM then cannot forward what an intrinsic stored
    there into registers, so each use stays a load, which x86 folds into the instruction using
    it (a scale broadcast from memory instead of a shuffle, on the port the FMAs need)."""

    def codegen(context, builder, signature, args):
        return builder.asm(ir.FunctionType(args[0].type, [args[0].type]), "", "=r,0", [args[0]], side_effect=False)

    return ptr(ptr), codegen


@intrinsic
def f32_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a · b + c for float32 with one rounding (llvm.fma): a multiply-add that does not depend on
    whether LLVM contracts it, which may differ between a kernel compiled in the process and the
    same kernel loaded from numba's cache."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen
