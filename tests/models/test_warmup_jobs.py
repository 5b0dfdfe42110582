"""A network's own one-token kernels (Decoder.kernel_jobs) compile at load in the worker processes beside the
block types' GEMVs: each in a fresh process over a kernel cache of the test's own, which starts with the suite's
compiled quant kernels but one (so the workers have two jobs: that GEMV and the network's), the load (its
warmup step too) and a first prefill and decode step then compile none of the jobs' kernels in the process
itself, only the layers' own calls, which need the GEMVs first."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from numba.core import config

import pagelm
from pagelm.runtime import kernel_cache
from pagelm.tools.synth import write_model
from pagelm.tools.synth_shapes import SHAPES

FIRST_STEP = """
import json, sys
from numba.core import event
from pagelm.engine.load import load_model
from pagelm.quant.precompile import _cached

here = event.RecordingListener()
with event.install_listener("numba:compile", here):
    model = load_model(sys.argv[1], threads=2)  # with its warmup step
    session = model.session()
    session.prefill([1, 2, 3, 4, 5])
    session.decode(6)
jobs = model.network.kernel_jobs()
cached = [_cached(k) for job in jobs for k in job.kernels]
names = sorted({ev.data["dispatcher"].py_func.__name__ for _, ev in here.buffer if ev.is_start})
print(json.dumps({"jobs": [job.function for job in jobs], "cached": cached, "compiled_here": names}))
"""


@pytest.mark.parametrize("shape, jobs", [("llama3.2-tiny", ["warmup"]), ("qwen3.5-tiny", ["warmup", "warmup"])])
def test_a_networks_one_token_kernels_compile_at_load_in_the_workers(tmp_path, shape, jobs):
    path = tmp_path / f"{shape}.gguf"
    write_model(str(path), SHAPES[shape], name=shape)
    suite = os.path.join(config.CACHE_DIR, "pagelm", "quant")  # precompiled by conftest
    ours = kernel_cache.directory(pagelm.__version__).name
    shutil.copytree(suite, tmp_path / "cache" / ours / "pagelm" / "quant",
                    ignore=shutil.ignore_patterns("matmul._matmul_kernels.locals.mv_Q8_0-*"))  # Q8_0 layers
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PAGELM_CACHE=str(tmp_path / "cache"), NUMBA_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", FIRST_STEP, str(path)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["jobs"] == jobs and all(seen["cached"])
    assert not {"_empty", "_append", "attend_heads", "_tokens"} & set(seen["compiled_here"]), seen["compiled_here"]
