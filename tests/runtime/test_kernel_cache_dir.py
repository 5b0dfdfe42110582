"""The per-user kernel cache (pagelm.runtime.kernel_cache) and the line that says kernels compile
(pagelm.quant.compile_progress), each run in a fresh process over a cache of the test's own: one
kernel (Q8_0's one-row GEMV) compiled into an empty cache, loaded from a warm one, rebuilt from a damaged one."""

import os
import subprocess
import sys

from pagelm.runtime import kernel_cache

ONE_KERNEL = """
import numpy as np
from pagelm.quant import GGMLType, encode, matmul
from pagelm.quant.compile_progress import CompileProgress

w = encode(np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32), GGMLType.Q8_0).reshape(-1)
x, out = np.ones((1, 64), np.float32), np.empty((1, 1), np.float32)
with CompileProgress():
    matmul.rows_matmul(w, GGMLType.Q8_0, np.zeros(1, np.int64), 64, x, out)
print(out.tobytes().hex())
"""


def _run(code: str, cwd=None, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=600,
                          cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_cache_lives_under_pagelm_cache_else_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGELM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.root() == tmp_path / "pagelm" / "kernels"
    monkeypatch.setenv("PAGELM_CACHE", str(tmp_path / "elsewhere"))
    name = kernel_cache.directory("1.2.3").name
    assert kernel_cache.directory("1.2.3").parent == tmp_path / "elsewhere"
    assert name.startswith("pagelm-1.2.3-numba-") and "-llvmlite-" in name and "unknown" not in name


def test_importing_pagelm_points_numba_at_the_cache_unless_the_user_did(tmp_path):
    code = "import os, pagelm; print(os.environ['NUMBA_CACHE_DIR'])"
    assert _run(code, PAGELM_CACHE=str(tmp_path)).stdout.strip().startswith(str(tmp_path / "pagelm-"))
    assert _run(code, PAGELM_CACHE=str(tmp_path), NUMBA_CACHE_DIR="/mine").stdout.strip() == "/mine"
    numba_first = "import numba, pagelm; from numba.core import config; print(config.CACHE_DIR)"
    assert _run(numba_first, PAGELM_CACHE=str(tmp_path)).stdout.strip().startswith(str(tmp_path / "pagelm-"))


def test_a_cold_cache_says_it_compiles_a_warm_one_says_nothing_a_damaged_one_is_rebuilt(tmp_path):
    cold = _run(ONE_KERNEL, PAGELM_CACHE=str(tmp_path))
    assert "compiling kernels for Q8_0 (first run only) …" in cold.stderr
    assert "compiled 1 kernels for Q8_0 in" in cold.stderr
    warm = _run(ONE_KERNEL, PAGELM_CACHE=str(tmp_path))
    assert warm.stderr == "" and warm.stdout == cold.stdout

    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert any(f.endswith(".nbc") for f in files) and any(f.endswith(".nbi") for f in files)
    for suffix, damage in ((".nbc", b"not a pickle"), (".nbi", b"\x80\x05garbage")):
        for f in files:
            if f.endswith(suffix):
                with open(f, "wb") as out:
                    out.write(damage)
        rebuilt = _run(ONE_KERNEL, PAGELM_CACHE=str(tmp_path))
        assert "compiled 1 kernels for Q8_0" in rebuilt.stderr and rebuilt.stdout == cold.stdout
    assert _run(ONE_KERNEL, PAGELM_CACHE=str(tmp_path)).stderr == ""


def test_a_copy_of_pagelm_elsewhere_finds_the_kernels_another_copy_compiled(tmp_path):
    """A second virtualenv, a reinstall or any copy of the same sources at another path: numba names a cache
    folder after the absolute path of the source, pagelm's locator after its place in the package."""
    import shutil

    source = os.path.dirname(os.path.dirname(os.path.abspath(kernel_cache.__file__)))
    copies = []
    for name in ("venv-a", "venv-b"):
        shutil.copytree(source, tmp_path / name / "pagelm", ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(str(tmp_path / name))
    cache = str(tmp_path / "cache")
    locate = "import pagelm.quant.matmul as m; print(m.__file__, m._block(8)[0][0]._cache._cache_path)"
    for copy in copies:  # each process imports its own copy (cwd: not the checkout's)
        where, folder = _run(locate, cwd=tmp_path, PAGELM_CACHE=cache, PYTHONPATH=copy).stdout.split()
        assert where.startswith(copy) and folder.startswith(cache) and folder.endswith(os.path.join("pagelm", "quant"))
    first = _run(ONE_KERNEL, cwd=tmp_path, PAGELM_CACHE=cache, PYTHONPATH=copies[0])
    assert "compiled 1 kernels for Q8_0" in first.stderr
    second = _run(ONE_KERNEL, cwd=tmp_path, PAGELM_CACHE=cache, PYTHONPATH=copies[1])
    assert second.stderr == "" and second.stdout == first.stdout


WORKERS = """
import io, json
from pagelm.quant import GGMLType, head
from numba.core import event
from pagelm.quant.compile_progress import CompileProgress
from pagelm.quant.precompile import Job, _cached, compile_missing

jobs = [Job("pagelm.quant.head", "warmup", ({t}, ("gather",)), (head._GATHER[t],), t.name)
        for t in (GGMLType.Q8_0, GGMLType.Q6_K)]
before = [_cached(j.kernels[0]) for j in jobs]
line = io.StringIO()
with CompileProgress(stream=line, live=True):
    compile_missing(jobs, workers=2)
here = event.RecordingListener()
with event.install_listener("numba:compile", here):
    head.warmup(parts=("gather",))
print(json.dumps({"before": before, "after": [_cached(j.kernels[0]) for j in jobs], "line": line.getvalue(),
                  "compiled_here": len(here.buffer)}))
"""


def test_kernels_the_cache_lacks_compile_in_worker_processes_and_then_load(tmp_path):
    """From a script without a main guard: the workers must not run the script again (multiprocessing's would)."""
    import json

    script = tmp_path / "script.py"
    script.write_text(WORKERS)
    runs = [_run(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", PAGELM_CACHE=str(tmp_path / "cache"))
            for _ in range(2)]
    first, again = (json.loads(run.stdout.splitlines()[-1]) for run in runs)
    assert first["before"] == [False, False] and first["after"] == [True, True]
    assert "compiling kernels for Q8_0, Q6_K (first run only): 2 of 2 compiled" in first["line"]
    assert first["compiled_here"] == 0  # loaded from what the workers cached
    assert again["before"] == [True, True] and again["line"] == ""  # nothing to compile: no workers, no line


FAKE_POPEN = """
import subprocess
calls = []


class FakePopen:
    returncode = 0

    def __init__(self, argv, **kw):
        calls.append(argv[1:])

    def wait(self):
        return 0


subprocess.Popen = FakePopen
"""


def _tiny_q4_k_m(tmp_path):
    from pagelm.tools.synth import write_model
    from pagelm.tools.synth_shapes import SHAPES

    path = tmp_path / "tiny.gguf"
    write_model(str(path), SHAPES["qwen3-tiny"], mix="q4_k_m")
    return path


def _check_compile_command(argv: list[str]) -> None:
    named = dict(zip(argv[2::2], argv[3::2]))
    assert argv[:2] == ["-m", "pagelm.quant.precompile"] and named["--dtype"] == "bfloat16"
    assert set(named["--types"].split(",")) >= {"Q4_K", "Q6_K"} and "F32" not in named["--types"]  # norms are 1-D
    assert named["--tables"] in ("Q6_K", "Q8_0", "Q4_K")


def test_a_pull_compiles_the_files_block_types_in_a_process_of_its_own(tmp_path):
    """`pagelm pull`'s last step (sources.kernels_ahead.KernelsAhead.finish) hands the file's block types and table
    types to `python -m pagelm.quant.precompile` (whose jobs the test above runs) and imports no numba itself."""
    import json

    path = _tiny_q4_k_m(tmp_path)
    pull = (FAKE_POPEN + "import json, sys\n"
            "from pagelm.sources.kernels_ahead import KernelsAhead\n"
            "KernelsAhead().finish(sys.argv[1])\n"
            "print(json.dumps({'calls': calls, 'numba': 'numba' in sys.modules, 'torch': 'torch' in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", pull, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert not seen["numba"] and not seen["torch"]
    (argv,) = seen["calls"]
    _check_compile_command(argv)


def test_a_pull_starts_compiling_once_the_header_has_arrived(tmp_path, monkeypatch):
    """Beside the download (hub.pull's on_bytes): nothing while the header is cut short, the compile command once
    it parses (its tensors' data not there yet), started once; the download's end then waits for it."""
    from pagelm.formats.gguf import GGUFFile
    from pagelm.sources import kernels_ahead

    class Compile:
        def __init__(self, argv, **kw):
            started.append(argv[1:])
            self.waited = False

        def wait(self):
            self.waited, self.returncode = True, 0
            return 0

    path = _tiny_q4_k_m(tmp_path)
    data, part = path.read_bytes(), tmp_path / "tiny.gguf.incomplete"
    started = []
    monkeypatch.setattr(kernels_ahead.subprocess, "Popen", Compile)
    monkeypatch.setattr(kernels_ahead, "FIRST_TRY", 64)  # tried from 64 bytes on, at each doubling
    ahead = kernels_ahead.KernelsAhead()
    with GGUFFile.open(path) as whole:
        header_end = whole.data_offset
    assert header_end > 4 * 64
    for have in (32, 100, header_end // 2):  # too few to try; then a header cut short, twice
        part.write_bytes(data[:have])
        ahead.arrived(part, have, len(data))
    assert started == []
    have = header_end
    assert have < len(data)
    part.write_bytes(data[:have])
    ahead.arrived(part, have, len(data))
    ahead.arrived(part, 2 * have, len(data))
    (argv,) = started
    _check_compile_command(argv)
    ahead.finish(path)
    assert ahead.process.waited and len(started) == 1
