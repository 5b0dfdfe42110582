"""The one-token layers as compiled calls (pagelm.models.token_layers): a new process whose numba cache
is warm compiles nothing for them."""

import json
import subprocess
import sys

import pytest

# The compilations numba makes in a new process while loading (its warmup step too), a prefill and a first
# decode step: numba announces one per function it compiles rather than loads from its cache.
FIRST_STEP_COMPILES = """
import json, sys
import numpy as np
from numba.core import event
import pagelm

compiles = event.RecordingListener()
with event.install_listener("numba:compile", compiles):
    model = pagelm.load(sys.argv[1])
    session = model.session(max_len=16)
    logits = session.prefill([11, 400, 7, 3000, 12])
    session.decode(int(np.argmax(logits)))
print(json.dumps({"compiled_layers": bool(model.network._compiled),
                  "compiles": [e.data["dispatcher"].py_func.__qualname__ for _, e in compiles.buffer if e.is_start]}))
"""


def _first_step_compiles(path: str) -> dict:
    done = subprocess.run([sys.executable, "-c", FIRST_STEP_COMPILES, path], check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf", "lfm2_tiny_gguf"])
def test_a_new_process_with_a_warm_cache_compiles_nothing_for_its_first_step(request, fixture):
    """The first process fills numba's cache where it lacks something; the second takes everything
    from it: TokenLayers' typed lists (its kernels as first-class functions, file maps, row offsets,
    norms, biases) are built by cached compiled calls, not by typed.List's methods, which numba compiles
    again for each item type in every process."""
    path = request.getfixturevalue(fixture)
    _first_step_compiles(path)
    second = _first_step_compiles(path)
    assert second["compiled_layers"]  # the step ran as TokenLayers' compiled calls
    assert second["compiles"] == []
