"""Kernels made once per block type (or tile kind) are closures of the same code: each must carry a
name of its own. numba names a compiled function's symbols by its name and a per-process counter, so
two types compiled in two processes could get the same symbol; a process that then loaded both from
numba's cache found one type's code at the other's address (dispatchers and first-class functions
look entries up by symbol name). Seen: a Gemma 3 decode in a process after a SmolLM2 process had
filled the cache gave NaN logits (tests/engine/test_batch_decode.py's Gemma 3 case after the SmolLM2 case,
with a warm cache)."""

from pagelm.quant import int8dot, matmul, tiles


def _kernels():
    for mv_mm, dequant, _ in matmul._KERNELS.values():
        yield from (*mv_mm, dequant)
    yield from int8dot._KERNELS.values()
    for kernels in tiles._KERNELS.values():
        yield from kernels


def test_every_per_type_kernel_has_a_name_of_its_own():
    names = [k.py_func.__qualname__ for k in _kernels()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)[:6]
