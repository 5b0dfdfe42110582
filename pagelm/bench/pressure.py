"""`pagelm bench pressure`: what a model pays when memory pressure has dropped its file from
the page cache, and what the prefetch hints save (MADV_WILLNEED on the prompt's embedding rows; in a
mixture of experts also on each layer's routed experts before a prefill's products).

Runs in process on `pagelm.load(..., embedding="mapped")`. Evicting the file: MADV_DONTNEED on
the model's own map, then posix_fadvise(DONTNEED) (the fadvise alone evicts nothing while pages
are mapped). The hints are switched off by wrapping the model's embedding and by taking the
mixtures' expert pages away, not by editing the engine. Owns that experiment only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from pagelm.bench.inputs import display_name
from pagelm.bench.report import Panel, bar_chart, markdown_table
from pagelm.bench.server import progress
from pagelm.errors import PagelmError
from pagelm.models.moe import mixtures

CONDITIONS = ("warm, hint on", "warm, hint off", "cold, hint on", "cold, hint off")


class HintSwitchEmbedding:
    """The model's mapped embedding with the prefetch hint switchable, timing what the
    embedding stage of a prefill costs (hint + row lookups)."""

    def __init__(self, inner):
        self.inner = inner
        self.hint = True
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefetch(self, token_ids) -> None:
        if self.hint:
            start = time.perf_counter()
            self.inner.prefetch(token_ids)
            self.seconds += time.perf_counter() - start

    def lookup(self, token_ids) -> np.ndarray:
        start = time.perf_counter()
        rows = self.inner.lookup(token_ids)
        self.seconds += time.perf_counter() - start
        return rows


def evict(file) -> None:
    """Drop the model file's pages from this process and from the page cache."""
    file.mmap.madvise(mmap.MADV_DONTNEED)
    drop_cached(file.path)


def drop_cached(path: str) -> None:
    """posix_fadvise(DONTNEED) over the whole file: its pages leave the page cache unless a process maps them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(array: np.ndarray) -> float:
    """Fraction of the pages under a mapped array that are in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - start
    pages = -(-length // page)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vector) / pages


@dataclass
class PressureReport:
    model: str
    prompt_tokens: int
    n_runs: int
    ttft: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONDITIONS})
    embedding_s: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONDITIONS})
    resident_after_evict: list[float] = field(default_factory=list)
    expert_hints: int = 0  # mixtures of experts whose routed experts' hints switch with the embedding's

    def median(self, what: dict, condition: str) -> float:
        return statistics.median(what[condition])

    def table(self) -> str:
        rows = [[c, f"{self.median(self.ttft, c):.3f}", f"{1e3 * self.median(self.embedding_s, c):.1f}",
                 ", ".join(f"{t:.3f}" for t in self.ttft[c])] for c in CONDITIONS]
        return markdown_table(["page cache, prefetch hint", "TTFT s", "embedding rows ms", "TTFT per run s"],
                              rows, align="lrrl")

    def summary(self) -> list[str]:
        t, e = (lambda c: self.median(self.ttft, c)), (lambda c: 1e3 * self.median(self.embedding_s, c))
        lines = [f"cold penalty, {hint}: TTFT {t(f'cold, {hint}') - t(f'warm, {hint}'):+.3f} s "
                 f"(x{t(f'cold, {hint}') / t(f'warm, {hint}'):.2f}), embedding rows "
                 f"{e(f'cold, {hint}') - e(f'warm, {hint}'):+.1f} ms" for hint in ("hint off", "hint on")]
        lines.append(f"what the hint saves when cold: TTFT {t('cold, hint off') - t('cold, hint on'):+.3f} s, "
                     f"embedding rows {e('cold, hint off') - e('cold, hint on'):+.1f} ms; when warm: TTFT "
                     f"{t('warm, hint off') - t('warm, hint on'):+.3f} s, embedding rows "
                     f"{e('warm, hint off') - e('warm, hint on'):+.1f} ms")
        lines.append("token_embd pages still in the page cache after each eviction (mincore): "
                     + ", ".join(f"{100 * r:.1f} %" for r in self.resident_after_evict))
        if self.expert_hints:
            lines.append(f"the hint switches the routed experts' too, in all {self.expert_hints} mixtures of experts")
        return lines

    def markdown(self) -> str:
        lines = "\n".join(f"- {line}" for line in self.summary())
        return (f"Model `{self.model}`, in process (`pagelm.load(..., embedding=\"mapped\")`), a prompt of "
                f"{self.prompt_tokens} distinct random token ids (seed 0): TTFT is the prefill to the first "
                f"token's logits and its argmax; \"embedding rows\" is the part of it spent in the prefetch hint "
                f"and the row lookups. Warm: the same prompt just ran. Cold: the model file evicted "
                f"(`madvise(MADV_DONTNEED)` on the map, then `posix_fadvise(POSIX_FADV_DONTNEED)`), so the rows "
                f"and the tied output head are read from disk again. Hint off/on: the mapped embedding's "
                f"`prefetch` (MADV_WILLNEED on the prompt's rows) skipped or called. Conditions interleaved; "
                f"medians of {self.n_runs} run(s).\n\n{self.table()}\n\n{lines}\n")

    def chart(self, path: str) -> str:
        panels = [Panel("time to first token", "s", ["warm", "cold"],
                        {hint: [self.median(self.ttft, f"{cache}, {hint}") for cache in ("warm", "cold")]
                         for hint in ("hint off", "hint on")}),
                  Panel("embedding rows (hint + lookups)", "ms", ["warm", "cold"],
                        {hint: [1e3 * self.median(self.embedding_s, f"{cache}, {hint}") for cache in ("warm", "cold")]
                         for hint in ("hint off", "hint on")})]
        return bar_chart(path, panels, f"{self.model}: page cache warm vs evicted, prefetch hint on/off")


def run_pressure(name: str, path: str, n_runs: int, prompt_tokens: int, weights: str = "mapped") -> PressureReport:
    import pagelm

    progress(f"pressure {display_name(name)}: loading {path}")
    model = pagelm.load(path, embedding="mapped", weights=weights)
    if model.embedding.mode != "mapped":
        raise PagelmError("the pressure benchmark needs the mapped embedding")
    embedding = HintSwitchEmbedding(model.embedding)
    model.embedding = embedding
    vocab = embedding.vocab_size
    ids = np.random.default_rng(0).choice(vocab, size=min(prompt_tokens, vocab), replace=False).tolist()
    session = model.session(len(ids) + 8)
    hinted = [(experts, experts.pages) for experts in mixtures(model.network) if experts.pages is not None]
    report = PressureReport(display_name(name), len(ids), n_runs, expert_hints=len(hinted))

    def first_token(condition: str | None) -> None:
        session.reset()
        embedding.seconds = 0.0
        start = time.perf_counter()
        int(np.argmax(session.prefill(ids)))
        if condition is not None:
            report.ttft[condition].append(time.perf_counter() - start)
            report.embedding_s[condition].append(embedding.seconds)

    first_token(None)  # warms the page cache and whatever the first prefill initialises
    for run in range(1, n_runs + 1):
        for hint in ("hint off", "hint on"):
            progress(f"pressure {report.model}: run {run}/{n_runs}, {hint}")
            embedding.hint = hint == "hint on"
            for experts, pages in hinted:
                experts.pages = pages if embedding.hint else None
            first_token(f"warm, {hint}")
            evict(model.file)
            report.resident_after_evict.append(resident_fraction(embedding.tensor.raw))
            first_token(f"cold, {hint}")
    return report
