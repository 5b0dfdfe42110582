"""Inlining in numba at a cost that follows the size of what is inlined.

numba inlines an `inline="always"` callee by copying its IR one block at a time, each block with a
`copy.deepcopy` of its own (numba 0.68.1, `InlineWorker.inline_ir`'s `copy_ir`); a variable copies its scope,
and the scope holds every variable of the callee, so each block copied the whole scope again: the cost of
an inline grew as the callee's blocks times its variables. pagelm's kernels inline kernels inside kernels
(a few-row GEMV inlines two passes, each two block unpackers, each the block ops of every type), and most of
their compile time went there: 12.1 of `mm_Q8_0`'s 13 s compiling.

Here one memo serves the whole of one inline, so the callee's scope is copied once and every copied block's
variables share that copy, as the original blocks' variables share the original. The machine code numba
emits is the same, symbol names aside (tests/runtime/test_numba_inline.py compares the assembly).
"""

from __future__ import annotations

import copy
import functools

PATCHED_NUMBA = "0.68.1"  # the numba whose copy_ir this was read from (pyproject pins it)


class _OneMemoPerInline:
    """Stands in for the `copy` module inside numba's inline_closurecall, whose only use of it is
    copy_ir's deepcopy: within one inline (`memo` set) every deepcopy without a memo of its own shares it."""

    memo: dict | None = None

    def deepcopy(self, x, memo=None):
        return copy.deepcopy(x, self.memo if memo is None else memo)

    def __getattr__(self, name):
        return getattr(copy, name)


def copy_scopes_once() -> bool:
    """Installs the shared memo into numba's inliner (once per process); False, doing nothing, under a
    numba other than PATCHED_NUMBA, whose inliner this has not been checked against."""
    import numba
    from numba.core import inline_closurecall

    if numba.__version__ != PATCHED_NUMBA:
        return False
    if isinstance(inline_closurecall.copy, _OneMemoPerInline):
        return True
    shim = _OneMemoPerInline()
    inline_ir = inline_closurecall.InlineWorker.inline_ir

    @functools.wraps(inline_ir)
    def inline_ir_one_memo(self, *args, **kwargs):
        outer, shim.memo = shim.memo, {}
        try:
            return inline_ir(self, *args, **kwargs)
        finally:
            shim.memo = outer

    inline_closurecall.copy = shim
    inline_closurecall.InlineWorker.inline_ir = inline_ir_one_memo
    return True
