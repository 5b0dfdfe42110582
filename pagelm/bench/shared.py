"""`pagelm bench shared`: two `pagelm serve` processes on the same model file, dense vs mapped.

Mapped embedding rows are pages of the file, shared by every process that maps it; an unpacked
table is private to each process. The second process's anonymous memory and PSS (its share of
every page it maps) show what one more server costs. Owns that measurement only.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pagelm.bench.inputs import MIB, display_name, embedding_table_mib
from pagelm.bench.memory import FIRST_CHAT
from pagelm.bench.memory import MODES as ALL_MODES

MODES = ("all dense", "all mapped")  # (embedding, weights) both dense, both mapped
from pagelm.bench.report import Panel, bar_chart, markdown_table
from pagelm.bench.server import ServerConfig, ServerProcess, mmproj_flags, progress
from pagelm.errors import PagelmError

FIELDS = ("anonymous", "pss_anon", "file_rss", "pss_file", "rss", "model_rss", "model_pss")


def model_file_pages(pid: int, path: str) -> tuple[int, int]:
    """(Rss, Pss) in bytes of the process's mappings of `path`, from /proc/PID/smaps: the model
    file alone, where RssFile and Pss_File also count every shared library."""
    target, rss, pss, inside = os.path.realpath(path), 0, 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line: range perms offset dev inode [path]
                inside = len(head) == 6 and head[5].strip() == target
            elif inside and head[0] in ("Rss:", "Pss:"):
                value = int(head[1]) * 1024
                rss, pss = (rss + value, pss) if head[0] == "Rss:" else (rss, pss + value)
    return rss, pss


def _chat(server: ServerProcess) -> None:
    reply = server.post("/api/chat", {"model": Path(server.model_path).stem, "messages": FIRST_CHAT,
                                      "stream": False, "think": False,
                                      "options": {"temperature": 0, "num_predict": 32}})
    if reply.status != 200:
        raise PagelmError(f"chat failed: HTTP {reply.status} {reply.body}")


def _figures(server: ServerProcess) -> dict:
    snapshot = server.memory()
    if snapshot.pss_anon is None:
        raise PagelmError("this kernel reports no Pss_Anon/Pss_File in smaps_rollup (needs Linux >= 5.8)")
    model_rss, model_pss = model_file_pages(server.pid, server.model_path)
    figures = {f: getattr(snapshot, f) / MIB for f in FIELDS if hasattr(snapshot, f)}
    return {**figures, "model_rss": model_rss / MIB, "model_pss": model_pss / MIB}


def measure_pair(path: str, mode: str, mmproj: str | None = None) -> tuple[dict, dict]:
    """(first process, second process) memory, both alive and each after one chat."""
    embedding, weights = ALL_MODES[mode]
    config = ServerConfig(embedding=embedding, weights=weights)
    flags = mmproj_flags(mmproj)
    with ServerProcess(path, config, flags) as first:
        _chat(first)
        with ServerProcess(path, config, flags) as second:
            _chat(second)
            return _figures(first), _figures(second)


@dataclass
class SharedReport:
    model: str
    table_mib: float
    n_runs: int
    runs: dict[str, list[tuple[dict, dict]]] = field(default_factory=lambda: {mode: [] for mode in MODES})

    def median(self, mode: str, which: int, key: str) -> float:
        return statistics.median(pair[which][key] for pair in self.runs[mode])

    def table(self) -> str:
        rows = []
        for mode in MODES:
            for which, label in ((0, "first"), (1, "second")):
                m = lambda key: self.median(mode, which, key)  # noqa: E731
                rows.append([mode, label, f"{m('anonymous'):.0f}", f"{m('pss_anon'):.0f}", f"{m('model_rss'):.0f}",
                             f"{m('model_pss'):.0f}", f"{m('file_rss'):.0f}", f"{m('pss_file'):.0f}",
                             f"{m('pss_anon') + m('pss_file'):.0f}", f"{m('rss'):.0f}"])
        return markdown_table(["mode", "process", "anonymous MiB", "PSS anon MiB", "model file RSS MiB",
                               "model file PSS MiB", "all files RSS MiB", "all files PSS MiB", "PSS MiB", "RSS MiB"],
                              rows, align="llrrrrrrrr")

    def summary(self) -> list[str]:
        second = {mode: {k: self.median(mode, 1, k) for k in FIELDS} for mode in MODES}
        pss = {mode: second[mode]["pss_anon"] + second[mode]["pss_file"] for mode in MODES}
        d, m = second["all dense"], second["all mapped"]
        return [f"second process, anonymous: dense {d['anonymous']:.0f} MiB, mapped {m['anonymous']:.0f} MiB "
                f"({d['anonymous'] - m['anonymous']:.0f} MiB less; the bf16 table is {self.table_mib:.0f} MiB)",
                f"second process, PSS: dense {pss['all dense']:.0f} MiB, mapped {pss['all mapped']:.0f} MiB "
                f"({pss['all dense'] - pss['all mapped']:.0f} MiB less)",
                f"model file pages of the second process, mapped: {m['model_rss']:.0f} MiB resident, of which "
                f"it is charged {m['model_pss']:.0f} MiB (the rest is the first process's share); dense: "
                f"{d['model_rss']:.0f} MiB resident, charged {d['model_pss']:.0f} MiB"]

    def markdown(self) -> str:
        lines = "\n".join(f"- {line}" for line in self.summary())
        return (f"Model `{self.model}`: two `pagelm serve` processes on the same file, both alive, each after one "
                f"short chat; figures from `/proc/PID/smaps_rollup`, the model file's own pages from "
                f"`/proc/PID/smaps`. PSS splits each shared page between the processes that map it; \"all "
                f"files\" also counts the shared libraries, shared with every Python process. Medians of "
                f"{self.n_runs} run(s), modes interleaved.\n\n{self.table()}\n\n{lines}\n")

    def chart(self, path: str) -> str:
        second = {mode: [self.median(mode, 1, "anonymous"),
                         self.median(mode, 1, "pss_anon") + self.median(mode, 1, "pss_file")] for mode in MODES}
        panel = Panel("second process on the same model file", "MiB", ["anonymous", "PSS (anon + file)"], second)
        return bar_chart(path, [panel], f"{self.model}: two pagelm serve processes, dense vs mapped")


def run_shared(name: str, path: str, n_runs: int, mmproj: str | None = None) -> SharedReport:
    report = SharedReport(display_name(name), embedding_table_mib(path), n_runs)
    for run in range(1, n_runs + 1):
        for mode in MODES:
            progress(f"shared {report.model}: run {run}/{n_runs}, {mode}, two processes")
            report.runs[mode].append(measure_pair(path, mode, mmproj))
    return report
