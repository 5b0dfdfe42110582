"""`pagelm bench peer`: one sequence of one file as a user runs it, pagelm and llama.cpp each in a
fresh process of its own, in turn: the time to the first token of a prompt, decode tokens per
second, the process's anonymous memory after (what it holds beyond the file's pages), and the time
from the process's start to that first token; with `cold`, the file evicted from the page cache
before each process.

Owns that measurement. Each process loads the file, warms up on a short prompt (kernels loaded,
pages in), then prefills the measured prompt and decodes greedily with a context of the same size
in both; the figures come back as one JSON line on stdout.
"""

from __future__ import annotations

import json
import mmap
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pagelm.bench.batch import load_llama_cpp_model
from pagelm.bench.report import markdown_table
from pagelm.errors import PagelmError
from pagelm.measure.memory import MIB, read_memory

RUNTIMES = ("pagelm", "llama.cpp")
WARMUP_TOKENS = 8
PROMPT_VOCAB = 32_000  # token ids every vocabulary here has, so both runtimes get the same prompt


def prompt_tokens(n: int) -> list[int]:
    return np.random.default_rng(49).integers(0, PROMPT_VOCAB, n).tolist()


def _figures(ttft: float, first_answer: float, decode_seconds: float, tokens: list[int]) -> dict:
    memory = read_memory()
    return {"ttft_s": ttft, "first_answer_s": first_answer, "decode_tps": (len(tokens) - 1) / decode_seconds,
            "tokens": tokens, "anonymous": memory.anonymous, "file_rss": memory.file_rss, "peak_rss": memory.peak_rss}


def evict(path: str) -> float:
    """Drops the file's pages from the page cache (no process maps it: the last one has exited);
    returns the fraction still resident (mincore through a fresh map, which faults nothing in)."""
    from pagelm.bench.pressure import drop_cached, resident_fraction

    drop_cached(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        array = np.frombuffer(view, np.uint8)
        try:
            return resident_fraction(array)
        finally:
            del array


def run_pagelm(path: str, n_prompt: int, n_tokens: int, n_ctx: int, threads: int, weights: str,
               launched: float) -> dict:
    import pagelm
    from pagelm.models.moe import track

    model = pagelm.load(path, weights=weights, threads=threads)
    traffic = track(model.network)
    warm = model.session(max_len=WARMUP_TOKENS + 4)
    warm.decode(int(np.argmax(warm.prefill(prompt_tokens(WARMUP_TOKENS)))))
    del warm
    session = model.session(max_len=n_ctx)
    start = time.perf_counter()
    tokens = [int(np.argmax(session.prefill(prompt_tokens(n_prompt))))]
    ttft, first_answer = time.perf_counter() - start, time.time() - launched
    if traffic is not None:
        traffic.reset()
    start = time.perf_counter()
    while len(tokens) < n_tokens:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    figures = _figures(ttft, first_answer, time.perf_counter() - start, tokens)
    if traffic is not None:
        figures.update(expert_bytes=traffic.expert_bytes, expert_bytes_per_token=traffic.per_token)
    return figures


def run_llama_cpp(path: str, n_prompt: int, n_tokens: int, n_ctx: int, threads: int, launched: float) -> dict:
    from llama_cpp import llama_cpp as c

    model = load_llama_cpp_model(path)
    vocab = c.llama_vocab_n_tokens(c.llama_model_get_vocab(model))
    ctx_params = c.llama_context_default_params()
    ctx_params.n_ctx = n_ctx
    ctx_params.n_batch = ctx_params.n_ubatch = n_prompt
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    ctx = c.llama_init_from_model(model, ctx_params)
    batch = c.llama_batch_init(n_prompt, 0, 1)

    def decode(ids: list[int], first: int) -> int:
        batch.n_tokens = len(ids)
        for k, token in enumerate(ids):
            batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = token, first + k, 1, k == len(ids) - 1
            batch.seq_id[k][0] = 0
        if c.llama_decode(ctx, batch) != 0:
            raise PagelmError("llama_decode failed")
        return int(np.argmax(np.ctypeslib.as_array(c.llama_get_logits_ith(ctx, len(ids) - 1), shape=(vocab,))))

    decode([decode(prompt_tokens(WARMUP_TOKENS), 0)], WARMUP_TOKENS)
    c.llama_memory_clear(c.llama_get_memory(ctx), True)
    start = time.perf_counter()
    tokens = [decode(prompt_tokens(n_prompt), 0)]
    ttft, first_answer = time.perf_counter() - start, time.time() - launched
    start = time.perf_counter()
    while len(tokens) < n_tokens:
        tokens.append(decode([tokens[-1]], n_prompt + len(tokens) - 1))
    return _figures(ttft, first_answer, time.perf_counter() - start, tokens)


def _in_fresh_process(runtime: str, path: str, n_prompt: int, n_tokens: int, n_ctx: int, threads: int,
                      weights: str) -> dict:
    command = [sys.executable, "-m", "pagelm.bench.peer", runtime, path, weights,
               *map(str, (n_prompt, n_tokens, n_ctx, threads)), repr(time.time())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class PeerReport:
    model: str
    prompt: int
    tokens: int
    weights: str
    runs: dict[str, list[dict]] = field(default_factory=lambda: {r: [] for r in RUNTIMES})
    cold: list[float] | None = None  # with the file evicted before each process: the fraction left resident

    def median(self, runtime: str, key: str) -> float | None:
        values = [run[key] for run in self.runs[runtime] if "error" not in run]
        return statistics.median(values) if values else None

    def errors(self) -> dict[str, str]:
        return {r: run["error"] for r in RUNTIMES for run in self.runs[r] if "error" in run}

    def same_tokens(self) -> int | None:
        """How many leading greedy tokens the two runtimes' first runs share."""
        first = [next((run["tokens"] for run in self.runs[r] if "error" not in run), None) for r in RUNTIMES]
        if None in first:
            return None
        return next((k for k, (a, b) in enumerate(zip(*first)) if a != b), min(map(len, first)))

    def markdown(self) -> str:
        rows = []
        for runtime in RUNTIMES:
            if self.median(runtime, "ttft_s") is None:
                continue
            rows.append([runtime, f"{self.median(runtime, 'ttft_s') * 1000:.0f}", f"{self.median(runtime, 'decode_tps'):.1f}",
                         f"{self.median(runtime, 'anonymous') / MIB:.0f}", f"{self.median(runtime, 'file_rss') / MIB:.0f}"])
        lines = [f"### One sequence: {self.model}", "",
                 f"A {self.prompt}-token prompt, then {self.tokens} greedy tokens (pagelm's weights {self.weights}); each "
                 f"runtime in a fresh process, in turn; medians of {len(self.runs['pagelm'])} run(s).", "",
                 markdown_table(["runtime", "TTFT (ms)", "decode tok/s", "anonymous MiB", "file-backed MiB"], rows), ""]
        both = [self.median(r, "ttft_s") for r in RUNTIMES]
        if None not in both:
            lines.append(f"pagelm / llama.cpp: decode {self.median('pagelm', 'decode_tps') / self.median('llama.cpp', 'decode_tps'):.2f}×, "
                         f"TTFT {both[1] / both[0]:.2f}× as fast, anonymous memory "
                         f"{self.median('pagelm', 'anonymous') / self.median('llama.cpp', 'anonymous'):.2f}×")
            lines.append(f"same greedy tokens: {self.same_tokens()} of {self.tokens} before the first difference")
        answers = {r: self.median(r, "first_answer_s") for r in RUNTIMES}
        if None not in answers.values():
            state = "the page cache warm" if self.cold is None else \
                f"the file evicted before each process ({max(self.cold):.1%} of it resident at most)"
            lines.append(f"first answer from the process's start (load, warmup, prompt), {state}: pagelm "
                         f"{answers['pagelm']:.1f} s, llama.cpp {answers['llama.cpp']:.1f} s "
                         f"({answers['llama.cpp'] / answers['pagelm']:.2f}× as fast)")
        touched = self.median("pagelm", "expert_bytes_per_token") if any(
            "expert_bytes" in run for run in self.runs["pagelm"]) else None
        if touched is not None:
            held = self.median("pagelm", "expert_bytes")
            lines.append(f"experts: {held / MIB:.0f} MiB in the file, {touched / MIB:.1f} MiB read per decoded token "
                         f"({touched / held:.1%})")
        lines += [f"{runtime}: {error}" for runtime, error in self.errors().items()]
        return "\n".join(lines)


def run_peer(name: str, path: str, n_prompt: int, n_tokens: int, n_ctx: int, runs: int, threads: int = 2,
             weights: str = "mapped", progress=lambda message: None, cold: bool = False) -> PeerReport:
    """`runs` rounds of a fresh pagelm process then a fresh llama.cpp process on the file at `path`;
    llama.cpp's turn reports its error when llama-cpp-python is missing or cannot run the file.
    `cold`: the file evicted from the page cache before each process."""
    report = PeerReport(name, n_prompt, n_tokens, weights, cold=[] if cold else None)
    for run in range(runs):
        for runtime in RUNTIMES:
            progress(f"{name}: {runtime}, run {run + 1}/{runs}")
            if cold:
                report.cold.append(evict(path))
            report.runs[runtime].append(_in_fresh_process(runtime, path, n_prompt, n_tokens, n_ctx, threads, weights))
    return report


if __name__ == "__main__":  # one runtime's turn, in the process run_peer started at wall time `launched`
    runtime, model_file, weights_mode, *numbers, launched = sys.argv[1:]
    if runtime == "pagelm":
        figures = run_pagelm(model_file, *map(int, numbers), weights_mode, float(launched))
    else:
        figures = run_llama_cpp(model_file, *map(int, numbers), float(launched))
    print(json.dumps(figures))
