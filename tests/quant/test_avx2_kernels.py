"""The GEMVs' AVX2 code (one row of W a pass, 2 rows of x; 1 for 256-value blocks), and the K-quants'
int8 GEMVs (their integer sums without VNNI), on an AVX-512
host, where the rest of the suite runs only the AVX-512 passes: a subprocess under bench/as_avx2.sh
(numba compiling for Haswell's name and instruction set), with its own cache, where every batch size
must still give each row its one-row bits, close to a float64 reference, and every int8 GEMV the
bits the host's code (AVX-512 VNNI's vpdpbusd where it has it) gives. (On an AVX2 host the other
kernel tests run this code already.)"""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from pagelm.quant import matmul

from test_int8dot import int8_outputs

CHECK = """
from pagelm.quant import GGMLType, matmul
assert not matmul.AVX512, "numba compiled for AVX-512, not for Haswell"
import test_batched_gemv, test_matmul
for name in ("Q8_0", "Q4_K", "F16", "MXFP4"):  # 32- and 256-value blocks, a float row with a tail, MXFP4's codes
    test_batched_gemv.test_every_batch_size_gives_each_row_its_one_row_bits(GGMLType[name])
    test_matmul.test_matmul_multiplies_gguf_weights_exactly(GGMLType[name])
test_matmul.test_dequantize_is_bit_identical_to_gguf_and_decode(GGMLType.MXFP4)  # unpacked as its GEMV does
import test_int8dot  # the K-quants' int8 sums, whose VNNI forms AVX2 lacks
for name in ("Q4_K", "Q5_K", "Q6_K"):
    test_int8dot.test_int8_matmul_matches_f64_product_of_its_operands(GGMLType[name])
import os, numpy
numpy.savez(os.environ["INT8_OUTPUTS"], **test_int8dot.int8_outputs())
print("checked")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="Haswell is an x86-64 CPU")
@pytest.mark.skipif(not matmul.AVX512, reason="the kernels compile for AVX2 here: the other kernel tests run it")
def test_the_avx2_kernels_give_every_row_its_one_row_bits(tmp_path):
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env.update(NUMBA_CACHE_DIR=str(tmp_path), INT8_OUTPUTS=str(tmp_path / "int8.npz"),
               PYTHONPATH=os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p))
    script = os.path.join(here, "..", "..", "bench", "as_avx2.sh")
    done = subprocess.run(["bash", script, sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]
    avx2 = np.load(env["INT8_OUTPUTS"])
    for case, out in int8_outputs().items():  # integer sums exact: VNNI's bits are AVX2's
        assert np.array_equal(avx2[case].view(np.uint32), out.view(np.uint32)), case
