"""`pagelm bench batch`: decode throughput of batches of sequences in process (weights mapped), and
the check that every sequence of every batched step got the logits it gets decoding alone.

Owns the measurement (and llama.cpp's, when llama_cpp is installed); presentation is report's.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pagelm.runtime import heap
from pagelm.bench.report import Panel, bar_chart, markdown_table
from pagelm.measure.memory import MIB, read_memory

PROMPT_TOKENS = 16  # each sequence's own prompt; sequence i's is PROMPT_TOKENS + 3 i tokens long
MEMORY_CTX = 4096  # the context each session of the memory measurement holds


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, min(vocab, 248_044), PROMPT_TOKENS + 3 * i).tolist() for i in range(n)]


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


def timed(fn, total: list[float], x_at: int = 0):
    """`fn` (a matrix product of its argument `x_at`), adding the seconds spent in it to `total[0]`
    and its floating-point operations (2 per multiply-add: x's values times the result's last
    dimension) to `total[1]`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        total[0] += time.perf_counter() - start
        total[1] += 2 * int(np.prod(args[x_at].shape)) * result.shape[-1]
        return result

    return wrapper


def timed_calls(fn, total: list[float]):
    """`fn` (compiled calls that run a step's products among other work), adding the seconds spent in it
    to `total[0]`."""

    def wrapper(*args):
        start = time.perf_counter()
        fn(*args)
        total[0] += time.perf_counter() - start

    return wrapper


@dataclass
class SizeRun:
    """One run of one batch size: seconds of its timed steps and their parts."""

    steps: int
    seconds: float
    matmul_s: float
    head_s: float
    flops: float  # of the matmuls and the head


@dataclass
class BatchReport:
    model: str
    path: str
    sizes: list[int]
    tokens: int
    runs: dict[int, list[SizeRun]] = field(default_factory=dict)
    checked: int = 0  # sequences whose every batched step was compared with decoding alone
    differing: int = 0
    llama_cpp: dict[int, float] = field(default_factory=dict)  # size -> aggregate tok/s
    llama_cpp_note: str = ""
    added_anonymous: float = 0.0  # anonymous bytes per sequence added to a batch of MEMORY_CTX-token sessions
    state_bytes: int = 0  # one such session's state (Session.nbytes)
    fma_peak: float = 0.0  # GFLOP/s of this machine's threads on FMA chains (bench.fma_peak)

    def aggregate(self, n: int) -> float:
        """Median aggregate tokens per second of batch size n."""
        return statistics.median(n * r.steps / r.seconds for r in self.runs[n])

    def _median_ms(self, n: int, part) -> float:
        return statistics.median(1e3 * part(r) / r.steps for r in self.runs[n])

    def markdown(self) -> str:
        base = self.aggregate(self.sizes[0]) / self.sizes[0] if 1 not in self.sizes else self.aggregate(1)
        rows = []
        for n in self.sizes:
            agg = self.aggregate(n)
            step = self._median_ms(n, lambda r: r.seconds)
            matmul, head = self._median_ms(n, lambda r: r.matmul_s), self._median_ms(n, lambda r: r.head_s)
            gflops = statistics.median(r.flops / (r.matmul_s + r.head_s) / 1e9 for r in self.runs[n])
            share = f" ({gflops / self.fma_peak:.0%})" if self.fma_peak else ""
            cpp = self.llama_cpp.get(n)
            rows.append([n, f"{agg:.1f}", f"{agg / n:.1f}", f"{step:.1f}",
                         f"{matmul:.1f} + {head:.1f} + {step - matmul - head:.1f}", f"{gflops:.0f}{share}",
                         f"{agg / base:.2f}×", "-" if cpp is None else f"{cpp:.1f}",
                         "-" if cpp is None else f"{agg / cpp:.2f}×"])
        table = markdown_table(["batch", "aggregate tok/s", "per-sequence tok/s", "ms/step",
                                "matmuls + head + rest ms", "matmuls + head GFLOP/s (of FMA peak)", "vs batch 1",
                                "llama.cpp tok/s", "pagelm/llama.cpp"], rows, "rrrrrrrrr")
        runs = len(next(iter(self.runs.values())))
        where = self.model if self.path == self.model else f"{self.model} ({self.path})"
        lines = [f"{where}, weights mapped, {self.tokens} decode steps per size, medians of {runs} runs", "",
                 table, ""]
        if self.fma_peak:
            lines += [f"float32 FMA peak of these threads: {self.fma_peak:.0f} GFLOP/s "
                      "(independent FMA chains on registers, bench.fma_peak)", ""]
        if self.llama_cpp_note:
            lines += [f"llama.cpp: {self.llama_cpp_note}", ""]
        if self.state_bytes:
            lines += [f"anonymous memory per added sequence: {self.added_anonymous / MIB:.1f} MiB "
                      f"(its state: {self.state_bytes / MIB:.1f} MiB, context {MEMORY_CTX})", ""]
        lines += [f"batch {n}: {self.aggregate(n) / base:.2f}× batch 1" for n in self.sizes]
        lines.append(f"differing sequences: {self.differing} of {self.checked}")
        return "\n".join(lines)

    def chart(self, path: str) -> str:
        categories = [str(n) for n in self.sizes]
        series = {"pagelm": [self.aggregate(n) for n in self.sizes]}
        if self.llama_cpp:
            series["llama.cpp"] = [self.llama_cpp.get(n, 0.0) for n in self.sizes]
        per_sequence = {"pagelm": [self.aggregate(n) / n for n in self.sizes]}
        return bar_chart(path, [Panel("aggregate decode", "tokens/s", categories, series),
                                Panel("per sequence", "tokens/s", categories, per_sequence)],
                         f"pagelm bench batch: {self.model}")


def _measure(model, prompts: list[list[int]], tokens: int, parts: tuple[list, list, list],
             layer_flops: int = 0) -> tuple[SizeRun, list, list]:
    """`tokens` batched greedy steps of len(prompts) fresh sessions: the timing, each sequence's
    tokens fed, and the digests of its logits after each step. parts: (seconds, flops) of the products
    and of the head, seconds in llama's compiled layer calls; a step that ran those counts them as its
    products, with `layer_flops` (every product's, one row) per sequence."""
    sessions = [model.session(max_len=len(p) + tokens + 2) for p in prompts]
    logits = np.stack([s.prefill(p) for s, p in zip(sessions, prompts)])
    fed, digests = [[] for _ in prompts], [[] for _ in prompts]
    matmul, head, compiled = parts
    seconds, matmul[:], head[:] = 0.0, [0.0, 0.0], [0.0, 0.0]
    for _ in range(tokens):
        step = [int(np.argmax(row)) for row in logits]
        before = compiled[0]
        start = time.perf_counter()
        logits = model.decode_batch(sessions, step)
        seconds += time.perf_counter() - start
        if compiled[0] > before:
            matmul[0] += compiled[0] - before
            matmul[1] += len(prompts) * layer_flops
        for i, (token, row) in enumerate(zip(step, logits)):
            fed[i].append(token)
            digests[i].append(_digest(row))
    return SizeRun(tokens, seconds, matmul[0], head[0], matmul[1] + head[1]), fed, digests


def _differs_alone(model, prompt: list[int], fed: list[int], digests: list[bytes]) -> bool:
    session = model.session(max_len=len(prompt) + len(fed) + 2)
    session.prefill(prompt)
    return any(_digest(session.decode(token)) != digest for token, digest in zip(fed, digests))


def _added_anonymous(model, prompts: list[list[int]]) -> tuple[float, int]:
    """(anonymous bytes per sequence added to a batch, one session's state bytes): the process's
    anonymous memory with one MEMORY_CTX-token session after a decode step, then with len(prompts)
    sessions after a batched step of all of them, the heap's free pages returned both times."""
    sessions: list = []

    def grow_and_step(n: int) -> int:
        while len(sessions) < n:
            session = model.session(max_len=MEMORY_CTX)
            session.prefill(prompts[len(sessions)])
            sessions.append(session)
        model.decode_batch(sessions, [1] * n)
        heap.trim()
        return read_memory().anonymous

    one = grow_and_step(1)
    return (grow_and_step(len(prompts)) - one) / (len(prompts) - 1), sessions[0].nbytes


_llama_quiet = None  # llama.cpp's log callback, kept alive while llama.cpp may call it


def silence_llama_cpp() -> None:
    """Drop llama.cpp's log (a few hundred lines a model), which would bury the progress lines."""
    from llama_cpp import llama_cpp as c

    global _llama_quiet
    if _llama_quiet is None:
        _llama_quiet = c.llama_log_callback(lambda level, text, user_data: None)
        c.llama_log_set(_llama_quiet, None)


def load_llama_cpp_model(path: str):
    """llama.cpp's model of the file at `path` (llama-cpp-python's low-level API), its log silenced."""
    from llama_cpp import llama_cpp as c

    silence_llama_cpp()
    params = c.llama_model_default_params()
    params.use_extra_bufts = False  # peers.md: the AMX matmul path crashes on these machines
    model = c.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def _llama_cpp_aggregate(path: str, prompts: list[list[int]], tokens: int, threads: int) -> float:
    """llama.cpp's aggregate decode tokens per second for the same sequences: each prompt decoded
    as its own sequence, then `tokens` greedy steps of all of them in one llama_batch a step."""
    from llama_cpp import llama_cpp as c

    n = len(prompts)
    model = load_llama_cpp_model(path)
    ctx_params = c.llama_context_default_params()
    ctx_params.n_ctx = sum(len(p) for p in prompts) + n * (tokens + 2)
    ctx_params.n_batch = ctx_params.n_ubatch = max(len(p) for p in prompts) + n
    ctx_params.n_seq_max = n
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    ctx = c.llama_init_from_model(model, ctx_params)
    n_vocab = c.llama_vocab_n_tokens(c.llama_model_get_vocab(model))
    batch = c.llama_batch_init(ctx_params.n_batch, 0, n)
    try:
        def decode(entries):  # (token, position, sequence, wants logits)
            batch.n_tokens = len(entries)
            for k, (token, pos, seq, wants) in enumerate(entries):
                batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = token, pos, 1, wants
                batch.seq_id[k][0] = seq
            if c.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def argmax(k: int) -> int:
            return int(np.argmax(np.ctypeslib.as_array(c.llama_get_logits_ith(ctx, k), shape=(n_vocab,))))

        nexts = []
        for seq, prompt in enumerate(prompts):
            decode([(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)])
            nexts.append(argmax(len(prompt) - 1))
        start = time.perf_counter()
        for step in range(tokens):
            decode([(nexts[s], len(prompts[s]) + step, s, True) for s in range(n)])
            nexts = [argmax(s) for s in range(n)]
        return n * tokens / (time.perf_counter() - start)
    finally:
        c.llama_batch_free(batch)
        c.llama_free(ctx)
        c.llama_model_free(model)


def llama_cpp_missing() -> str:
    """Why llama.cpp's figures cannot be measured here; empty when they can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "not installed (pip install llama-cpp-python), not measured"
    except Exception as e:  # noqa: BLE001 - installed but its library did not load (e.g. LLAMA_CPP_LIB_PATH unset)
        return f"installed but not loadable ({type(e).__name__}: {e}), not measured"
    return ""


def run_batch(name: str, path: str, sizes: list[int], tokens: int, runs: int, threads: int = 2,
              dtype: str = "bfloat16") -> BatchReport:
    """Every size's batched decode `runs` times (sizes interleaved within a run), the first run
    checked sequence by sequence against decoding alone; when llama.cpp is installed, its figure for
    each size right after pagelm's, so that a shared host's slow stretch falls on both."""
    import pagelm
    from pagelm.bench.fma_peak import fma_peak_gflops  # here: bench peer's llama.cpp child imports no numba
    from pagelm.models import token_layers
    from pagelm.weights import linear

    model = pagelm.load(path, dtype=dtype, threads=threads)
    parts = ([0.0, 0.0], [0.0, 0.0], [0.0])  # (seconds, flops) of the matmuls, of the head; llama's compiled layers
    linear.MappedLinear.rows = timed(linear.MappedLinear.rows, parts[0], x_at=1)  # after self; a decode step's every product
    model.head.logits = timed(model.head.logits, parts[1])
    # llama's compiled layers run their products inside two calls (with the norms, rope and attention)
    token_layers.to_activation = timed_calls(token_layers.to_activation, parts[2])
    token_layers.last_down = timed_calls(token_layers.last_down, parts[2])
    layer_flops = 2 * sum(m.in_features * m.out_features for w in model.network.layers for m in vars(w).values()
                          if isinstance(m, linear.Linear))
    prompts = _prompts(model.head.vocab_size, max(sizes))
    report = BatchReport(name, path, sizes, tokens, {n: [] for n in sizes})
    _measure(model, prompts[:1], 2, parts)  # warm: kernels loaded, pages in
    if max(sizes) > 1:
        report.added_anonymous, report.state_bytes = _added_anonymous(model, prompts)
    peak_before = fma_peak_gflops(threads)  # and after the runs: a shared host's slow moment shows as one low
    report.llama_cpp_note = llama_cpp_missing()
    cpp: dict[int, list[float]] = {} if report.llama_cpp_note else {n: [] for n in sizes}
    for run in range(runs):
        for n in sizes:
            print(f"pagelm bench batch: run {run + 1}/{runs}, batch {n}", file=sys.stderr, flush=True)
            result, fed, digests = _measure(model, prompts[:n], tokens, parts, layer_flops)
            report.runs[n].append(result)
            if run == 0:
                report.checked += n
                report.differing += sum(_differs_alone(model, prompts[i], fed[i], digests[i]) for i in range(n))
            if n in cpp:
                try:
                    cpp[n].append(_llama_cpp_aggregate(path, prompts[:n], tokens, threads))
                except Exception as e:  # noqa: BLE001 - llama.cpp's own failure (e.g. a hybrid model's batch) is a result
                    report.llama_cpp_note = f"batch {n} failed: {type(e).__name__}: {e}"
                    cpp = {m: v for m, v in cpp.items() if m < n}
    report.fma_peak = max(peak_before, fma_peak_gflops(threads))
    report.llama_cpp = {n: statistics.median(v) for n, v in cpp.items() if v}
    return report
