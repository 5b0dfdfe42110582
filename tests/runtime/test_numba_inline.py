"""runtime.numba_inline: numba's inliner with one memo an inline emits the same machine code, and copies far
fewer variables, for a function that inlines functions with many blocks, inside functions it inlines."""

import re
import subprocess
import sys

import numba

from pagelm.runtime import numba_inline

KERNELS = '''
import sys
import numpy as np
from numba import njit
from numba.core import ir

if sys.argv[1] == "one-memo":
    from pagelm.runtime import numba_inline
    assert numba_inline.copy_scopes_once()

copied = [0]
var_deepcopy = ir.Var.__deepcopy__
def counting(self, memo):
    copied[0] += 1
    return var_deepcopy(self, memo)
ir.Var.__deepcopy__ = counting

@njit(inline="always")
def branchy(kind, x, i):
    v = x[i]
    if kind == 0:
        v = v * 2.0 + 1.0
    elif kind == 1:
        for j in range(3):
            v = v * v - j
    elif kind == 2:
        v = -v if v > 0 else v / 3.0
    else:
        while v > 1.0:
            v = v / 2.0
    return v

@njit(inline="always")
def twice(kind, x, i):
    return branchy(kind, x, i) + branchy(kind + 1, x, i + 1)

@njit
def kernel(x):
    s = 0.0
    for i in range(x.shape[0] - 1):
        s += twice(i % 4, x, i) - twice(3 - i % 4, x, i)
    return s

x = np.linspace(-2.0, 3.0, 11)
print("result", kernel(x).hex())
print("copied", copied[0])
'''


def _compile(tmp_path, mode: str) -> tuple[str, str, int]:
    script = tmp_path / "kernels.py"
    script.write_text(KERNELS)
    out = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True,
                         env={"NUMBA_DUMP_ASSEMBLY": "1", "NUMBA_CACHE_DIR": str(tmp_path / mode),
                              "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}).stdout
    result = re.search(r"^result (\S+)$", out, re.M).group(1)
    copied = int(re.search(r"^copied (\d+)$", out, re.M).group(1))
    # symbols carry the address of an object and a per-process counter: the rest must match
    assembly = re.sub(r"0x[0-9a-f]+|[0-9a-zA-Z]{20,}|\d+", "#", out[: out.index("\nresult ")])
    return result, assembly, copied


def test_one_memo_an_inline_emits_the_same_code_and_copies_less(tmp_path):
    assert numba.__version__ == numba_inline.PATCHED_NUMBA  # the pin in pyproject
    result, assembly, copied = _compile(tmp_path, "one-memo")
    numba_result, numba_assembly, numba_copied = _compile(tmp_path, "numba")
    assert result == numba_result
    assert "vaddsd" in assembly or "addsd" in assembly
    assert assembly == numba_assembly
    assert copied * 3 < numba_copied, (copied, numba_copied)


def test_installed_once_by_the_kernels():
    import pagelm.quant.codegen  # noqa: F401 - installs it
    from numba.core import inline_closurecall

    assert isinstance(inline_closurecall.copy, numba_inline._OneMemoPerInline)
    wrapped = inline_closurecall.InlineWorker.inline_ir
    assert numba_inline.copy_scopes_once()
    assert inline_closurecall.InlineWorker.inline_ir is wrapped
