"""Benchmark: what a pull costs and keeps when the network fails, `pagelm pull` vs huggingface_hub.

The loopback Hub of the tests (tests/sources/hub_server.py) serves a synthetic Qwen3.5 tiny-chat GGUF
(`pagelm synth --shape qwen3.5-tiny-chat`, 50.6 MB); each case starts from an empty Hugging Face cache:
the connection cut at 50 % of the file (once, the client retries in the same process), the client
interrupted (SIGINT, as Ctrl-C) once the Hub has sent half the file and then run again, one byte of
the file flipped, and the file already in the cache (downloaded by huggingface_hub first). The clients are `hf_hub_download` (huggingface_hub's
own download, in a process of its own) and `pagelm pull hf.co/org/qwen-tiny:Q8_0`. Prints one markdown
row per case and client: bytes the server sent (and as a multiple of the file), exit status, and
whether the file in the cache is the right one (sha256), absent, or wrong.

    python bench/hub_downloads.py
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sources"))
from hub_server import Fault, HubServer, RunningHub  # noqa: E402

REPO, FILE = "org/qwen-tiny", "qwen-tiny-Q8_0.gguf"
HF_DOWNLOAD = "from huggingface_hub import hf_hub_download as d; d(%r, %r)" % (REPO, FILE)
CASES = {"cut at 50 %": lambda: Fault(drop_at=0.5), "Ctrl-C at 50 %, run again": lambda: Fault(delay=0.01),
         "one byte flipped": lambda: Fault(corrupt=True)}


def _stored(cache: Path, sha256: str) -> str:
    files = list((cache / f"models--{REPO.replace('/', '--')}" / "snapshots").glob(f"*/{FILE}"))
    if not files:
        return "none stored"
    return "right" if hashlib.sha256(files[0].read_bytes()).hexdigest() == sha256 else "WRONG bytes stored"


def _client(command: list[str], hub: HubServer, cache: Path, interrupt_at: int | None = None) -> int:
    """The client's exit status; with `interrupt_at`, SIGINT once the Hub has sent that many bytes,
    then the same command again (the status of the second run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "home"),
               PAGELM_HOME=str(cache.parent / "pagelm"), HF_HUB_DISABLE_TELEMETRY="1")
    if interrupt_at is not None:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while hub.fetched(REPO) < interrupt_at and process.poll() is None:
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        process.wait()
        hub.faults.clear()
    return subprocess.run(command, env=env, capture_output=True, text=True).returncode


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pagelm-hub-bench-") as tmp:
        model = Path(tmp) / FILE
        subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", "qwen3.5-tiny-chat", "--quiet", str(model)],
                       check=True, stdout=subprocess.DEVNULL)
        size, sha256 = model.stat().st_size, hashlib.sha256(model.read_bytes()).hexdigest()
        hub = HubServer()
        hub.add(REPO, {FILE: model})
        running = RunningHub(hub)
        clients = {"huggingface_hub 2.4.0 hf_hub_download": [sys.executable, "-c", HF_DOWNLOAD],
                   "pagelm pull": [sys.executable, "-m", "pagelm", "pull", f"hf.co/{REPO}:Q8_0"]}
        print(f"file: {FILE}, {size:,} bytes\n")
        print("| case | client | bytes sent by the Hub | × file | exit | file in the cache |")
        print("|---|---|---:|---:|---:|---|")
        try:
            for n, (case, fault) in enumerate(CASES.items()):
                for m, (client, command) in enumerate(clients.items()):
                    cache = Path(tmp) / f"case{n}-{m}" / "hub"
                    hub.reset_counts()
                    hub.faults[(REPO, FILE)] = fault()
                    status = _client(command, hub, cache, size // 2 if case.startswith("Ctrl-C") else None)
                    sent = hub.fetched(REPO)
                    print(f"| {case} | {client} | {sent:,} | {sent / size:.2f} | {status} | {_stored(cache, sha256)} |")
            hub.faults.clear()
            cache = Path(tmp) / "shared" / "hub"
            _client(clients["huggingface_hub 2.4.0 hf_hub_download"], hub, cache)
            hub.reset_counts()
            status = _client(clients["pagelm pull"], hub, cache)
            print(f"| already downloaded by hf_hub_download | pagelm pull | {hub.fetched(REPO):,} | "
                  f"{hub.fetched(REPO) / size:.2f} | {status} | {_stored(cache, sha256)} |")
        finally:
            running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
