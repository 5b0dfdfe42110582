"""pagelm.runtime.heap in fresh processes: temporaries reused from the heap, not faulted in again, and
given back by trim."""

import subprocess
import sys

import pytest

from pagelm.runtime import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc's mallopt and malloc_trim")

# 40 temporaries of 16 MiB (4,096 pages each), as a prefill's activations come and go, then freed
# and trimmed; prints the page faults the last 20 took (the heap grows while the first ones settle
# around the small blocks between them: 1 to 8 of them faulted in) and the anonymous MiB trim gave back
_SCRIPT = """
import resource, sys, torch
from pagelm.runtime import heap
from pagelm.measure.memory import MIB, read_memory
if sys.argv[1] == "heap":
    assert heap.map_large_blocks()
else:  # every block of 128 KiB or more mapped on its own
    assert heap._libc().mallopt(heap._M_MMAP_THRESHOLD, 128 << 10) == 1
for i in range(40):
    if i == 20:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(4 << 20, dtype=torch.float32).sum()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
held = read_memory().anonymous
heap.trim()
print(faults, (held - read_memory().anonymous) // MIB)
"""


def _run(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], check=True, capture_output=True, text=True).stdout
    faults, released = map(int, out.split())
    return faults, released


def test_large_temporaries_reuse_the_heap_and_trim_gives_it_back():
    mapped_faults, _ = _run("mapped")
    faults, released = _run("heap")
    assert mapped_faults > 18 * 4096  # the contrast: each temporary's pages faulted in again
    assert faults < 4096  # none of the 20 temporaries faulted in again
    assert released >= 12  # the 16 MiB left free in the heap went back to the OS


@pytest.mark.parametrize("name", ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"])
def test_loading_a_model_bounds_the_gemm_caches_unless_the_user_set_them(smollm2_gguf, name):
    script = f"import os, pagelm; pagelm.load({smollm2_gguf!r}); print(os.environ[{name!r}])"
    env = {k: v for k, v in __import__("os").environ.items() if k != name}
    ours = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env).stdout
    theirs = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                            env={**env, name: "7"}).stdout
    assert (int(ours), int(theirs)) == (heap.GEMM_PRIMITIVES, 7)


# Anonymous MiB that bf16 GEMMs of 240 different row counts leave behind, after a trim: torch keeps state
# for every GEMM shape it has run, in oneDNN's primitive cache and in ideep's own.
SHAPES_LEFT = """
import torch
from pagelm.runtime import heap
from pagelm.measure.memory import read_memory
heap.map_large_blocks()
if {bound}:
    heap.bound_gemm_cache()
w = torch.randn(256, 512).to(torch.bfloat16)
torch.nn.functional.linear(torch.randn(17, 512).to(torch.bfloat16), w)
heap.trim()
before = read_memory().anonymous
for rows in range(20, 260):
    torch.nn.functional.linear(torch.randn(rows, 512).to(torch.bfloat16), w)
heap.trim()
print((read_memory().anonymous - before) / 2**20)
"""


def test_the_bounded_caches_keep_what_gemms_of_many_shapes_leave_behind_small():
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    left = [float(subprocess.run([sys.executable, "-c", SHAPES_LEFT.format(bound=bound)], check=True,
                                 capture_output=True, text=True, env=env).stdout) for bound in (False, True)]
    unbounded, bounded = left
    assert bounded < unbounded / 2, left
