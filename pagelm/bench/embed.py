"""`pagelm bench embed`: inputs per second of an embedding model, pagelm's passes of many inputs
beside llama.cpp's embedding mode on the same file and the same token inputs, and how close the two
runtimes' vectors are (cosine). Owns the measurement; presentation is report's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from pagelm.bench.batch import llama_cpp_missing
from pagelm.bench.report import markdown_table
from pagelm.bench.server import end_process

COSINE_FLOOR = 0.999  # the lowest cosine between the two runtimes' vectors of an input that counts as agreeing
FIRST_ID = 3  # past the special tokens (<pad>, <eos>, <bos>) every Gemma vocabulary starts with


def token_inputs(vocab: int, count: int, tokens: int) -> list[list[int]]:
    """`count` seeded inputs of `tokens` pseudo-random token ids each (the same for every count)."""
    rng = np.random.default_rng(0)
    return [rng.integers(FIRST_ID, vocab, tokens).tolist() for _ in range(count)]


class LlamaCppProcess:
    """llama.cpp's embedding mode on one file in a process of its own (pagelm.bench.llama_embed): a
    failed assertion in llama.cpp aborts its process (the tiny EmbeddingGemma's projection width
    does), which must not end the benchmark. Its stderr goes to a file, its last line the error."""

    def __init__(self, path: str, threads: int):
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "pagelm.bench.llama_embed", path, str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                        env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        self._reply()  # loaded

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self._stderr.seek(0)
            said = [text for text in self._stderr.read().decode(errors="replace").splitlines() if text.strip()]
            raise RuntimeError(f"its process ended (exit {self.process.returncode}): "
                               f"{said[-1] if said else 'nothing on stderr'}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def embed_all(self, inputs: list[list[int]]) -> tuple[float, np.ndarray]:
        """(seconds llama.cpp took, the vectors) of the inputs."""
        self.process.stdin.write(json.dumps({"inputs": inputs}) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        return reply["seconds"], np.asarray(reply["vectors"], np.float32)

    def close(self) -> None:
        end_process(self.process, lambda process: process.stdin.close(), 30)  # its end of input: it returns
        self._stderr.close()


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest cosine similarity between rows a[i] and b[i]."""
    dots = np.einsum("ij,ij->i", a.astype(np.float64), b.astype(np.float64))
    return float(np.min(dots / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


@dataclass
class EmbedReport:
    model: str
    counts: list[int]
    tokens: int
    threads: int
    pagelm: dict[int, list[float]] = field(default_factory=dict)  # inputs -> seconds of each run
    llama_cpp: dict[int, list[float]] = field(default_factory=dict)
    cosine: dict[int, float] = field(default_factory=dict)  # inputs -> lowest cosine, pagelm vs llama.cpp
    llama_cpp_note: str = ""

    @staticmethod
    def rate(n: int, seconds: list[float]) -> float:
        """Median inputs per second."""
        return statistics.median(n / s for s in seconds)

    def markdown(self) -> str:
        rows = []
        for n in self.counts:
            ours = self.rate(n, self.pagelm[n])
            theirs = self.rate(n, self.llama_cpp[n]) if self.llama_cpp.get(n) else None
            rows.append([n, f"{ours:.2f}", f"{ours * self.tokens:.0f}", "-" if theirs is None else f"{theirs:.2f}",
                         "-" if theirs is None else f"{ours / theirs:.2f}×",
                         f"{self.cosine[n]:.6f}" if n in self.cosine else "-"])
        table = markdown_table(["inputs", "pagelm inputs/s", "pagelm tokens/s", "llama.cpp inputs/s",
                                "pagelm/llama.cpp", "lowest cosine to llama.cpp"], rows, "rrrrrr")
        runs = len(next(iter(self.pagelm.values())))
        lines = [f"{self.model}: inputs of {self.tokens} seeded token ids, {self.threads} threads, weights mapped bf16, "
                 f"medians of {runs} runs", "", table, ""]
        if self.llama_cpp_note:
            lines += [f"llama.cpp: {self.llama_cpp_note}", ""]
        for n in self.counts:
            line = f"inputs {n}: pagelm {self.rate(n, self.pagelm[n]):.2f} inputs/s"
            if self.llama_cpp.get(n):
                line += (f", llama.cpp {self.rate(n, self.llama_cpp[n]):.2f} inputs/s, "
                         f"{self.rate(n, self.pagelm[n]) / self.rate(n, self.llama_cpp[n]):.2f}×")
            lines.append(line)
        if self.cosine:
            lowest = min(self.cosine.values())
            lines.append(f"vectors: lowest cosine to llama.cpp's {lowest:.6f} "
                         f"({'at least' if lowest >= COSINE_FLOOR else 'below'} {COSINE_FLOOR})")
        return "\n".join(lines)


def _seconds(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def run_embed(name: str, path: str, counts: list[int], tokens: int, runs: int, threads: int = 2) -> EmbedReport:
    """Each count of inputs embedded `runs` times by pagelm (Embedder.embed_all) and, when llama_cpp
    is installed, right after by llama.cpp on the same file; llama.cpp's failure is reported, not raised."""
    from pagelm.engine.embed import Embedder
    from pagelm.engine.load import load_model

    embedder = Embedder.of(load_model(path, threads=threads))
    inputs = token_inputs(embedder.model.config.vocab, max(counts), tokens)
    report = EmbedReport(name, counts, tokens, threads, {n: [] for n in counts})
    report.llama_cpp_note = llama_cpp_missing()
    llama = None
    if not report.llama_cpp_note:
        try:
            llama = LlamaCppProcess(path, threads)
            report.llama_cpp = {n: [] for n in counts}
        except Exception as e:  # noqa: BLE001 - llama.cpp's own failure to run the file is a result
            report.llama_cpp_note = f"{type(e).__name__}: {e}"
    try:
        for run in range(runs):
            for n in counts:
                print(f"pagelm bench embed: run {run + 1}/{runs}, {n} inputs", file=sys.stderr, flush=True)
                if run == 0:  # warm: kernels loaded, pages in, the pass's memory allocated once
                    embedder.embed_all(inputs[:n])
                seconds, ours = _seconds(embedder.embed_all, inputs[:n])
                report.pagelm[n].append(seconds)
                if llama is not None and n in report.llama_cpp:
                    try:
                        if run == 0:  # warm, as pagelm
                            llama.embed_all(inputs[:n])
                        seconds, theirs = llama.embed_all(inputs[:n])
                        report.llama_cpp[n].append(seconds)
                        report.cosine[n] = lowest_cosine(ours, theirs)
                    except Exception as e:  # noqa: BLE001 - as above
                        report.llama_cpp_note = f"{n} inputs failed: {type(e).__name__}: {e}"
                        del report.llama_cpp[n]
    finally:
        if llama is not None:
            llama.close()
    return report
