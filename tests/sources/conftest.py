"""A loopback Hugging Face Hub (hub_server.py) serving synthetic models pagelm writes, started once
per session; each test gets an empty Hugging Face cache and pagelm store, and `pagelm` processes
that reach the Hub only through HF_ENDPOINT.
"""

import os
import subprocess
import sys

import pytest
from hub_server import HF_DIR, PRIVATE, QWEN, SPLIT, TINY, TOKEN, HubServer, RunningHub


def _tiny(path, seed=0, layer_type="Q8_0"):
    from pagelm.quant.types import GGMLType
    from pagelm.tools.synth import SHAPES, write_model

    write_model(str(path), SHAPES["qwen3.5-tiny"], GGMLType[layer_type], seed=seed, name="synthetic qwen3.5-tiny")
    return path


@pytest.fixture(scope="session")
def hub_files(tmp_path_factory, qwen35_chat_gguf):
    """The repositories' files, written as `pagelm synth` writes them."""
    from pagelm.quant.types import GGMLType
    from pagelm.tools.synth import SHAPES, write_model
    from pagelm.tools.synth_tower import SHAPES as TOWERS
    from pagelm.tools.synth_tower import write_mmproj
    from pagelm.tools.convert import write_directory

    d = tmp_path_factory.mktemp("hub-files")
    files = {"qwen-Q8_0": qwen35_chat_gguf, "qwen-Q4_0": d / "qwen-tiny-Q4_0.gguf",
             "mmproj-F16": d / "mmproj-F16.gguf", "mmproj-BF16": d / "mmproj-BF16.gguf"}
    write_model(str(files["qwen-Q4_0"]), SHAPES["qwen3.5-tiny-chat"], GGMLType.Q4_0, seed=0, name="qwen Q4_0")
    write_mmproj(str(files["mmproj-F16"]), TOWERS["qwen3.5-tiny-chat"], seed=1)
    write_mmproj(str(files["mmproj-BF16"]), TOWERS["qwen3.5-tiny-chat"], seed=2)  # only its name says BF16
    files["tiny-a"], files["tiny-a2"] = _tiny(d / "tiny-a.gguf", seed=0), _tiny(d / "tiny-a2.gguf", seed=1)
    files["tiny-b"] = _tiny(d / "tiny-b.gguf", layer_type="Q4_0")
    data = files["tiny-a"].read_bytes()
    for i, part in enumerate((data[:len(data) // 2], data[len(data) // 2:])):
        files[f"split-{i + 1}"] = d / f"split-{i + 1}.gguf"
        files[f"split-{i + 1}"].write_bytes(part)
    write_directory(str(files["tiny-a"]), str(d / "hf"), "hf")
    files["readme"] = d / "README.md"
    files["readme"].write_text("# a model card\n")
    files["pth"] = d / "consolidated.pth"
    files["pth"].write_bytes(os.urandom(4096))
    files["hf"] = d / "hf"
    return files


@pytest.fixture(scope="session")
def hub(hub_files):
    from pathlib import Path

    f = {k: Path(v) for k, v in hub_files.items()}
    server = HubServer()
    server.add(QWEN, {"qwen-tiny-Q8_0.gguf": f["qwen-Q8_0"], "qwen-tiny-Q4_0.gguf": f["qwen-Q4_0"],
                      "mmproj-F16.gguf": f["mmproj-F16"], "mmproj-BF16.gguf": f["mmproj-BF16"],
                      "README.md": f["readme"]})
    server.old_tiny = server.add(TINY, {"tiny-Q8_0.gguf": f["tiny-a"], "tiny-Q4_0.gguf": f["tiny-b"]}, branch=None)
    server.add(TINY, {"tiny-Q8_0.gguf": f["tiny-a2"], "tiny-Q4_0.gguf": f["tiny-b"], "README.md": f["readme"]})
    server.add(SPLIT, {"tiny-Q8_0-00001-of-00002.gguf": f["split-1"], "tiny-Q8_0-00002-of-00002.gguf": f["split-2"]})
    server.add(HF_DIR, {**{p.name: p for p in f["hf"].iterdir()}, "README.md": f["readme"],
                        "original/consolidated.pth": f["pth"]})
    server.add(PRIVATE, {"tiny-Q8_0.gguf": f["tiny-b"]})
    server.tokens[PRIVATE] = TOKEN
    running = RunningHub(server)
    yield server
    running.stop()


@pytest.fixture
def env(hub, tmp_path):
    """The environment of a `pagelm` process: an empty cache and store, the loopback Hub, no token."""
    hub.reset_counts()
    hub.faults.clear()
    hub.hostile.clear()
    hub.busy_listings = 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    environment.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                       PAGELM_HOME=str(tmp_path / "pagelm"), HF_HUB_DISABLE_TELEMETRY="1",
                       OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return environment


@pytest.fixture
def pagelm(env):
    """Run `pagelm ARGS` in `env` (plus `extra` variables); the finished process."""
    def run(*args: str, extra: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagelm", *args], capture_output=True, text=True,
                              env={**env, **(extra or {})}, timeout=600)
    return run
