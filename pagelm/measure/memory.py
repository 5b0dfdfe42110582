"""Memory figures of a process, read from Linux /proc: anonymous vs file-backed.

Owns only reading and formatting; it never allocates on the measured process's behalf.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pagelm.errors import PagelmError

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes, as the kernel reports them (kB granularity)."""

    pid: int
    anonymous: int  # smaps_rollup Anonymous: private heap, numpy buffers, unpacked tables
    file_rss: int  # status RssFile: resident pages of mapped files (the model)
    rss: int  # status VmRSS
    peak_rss: int  # status VmHWM
    pss_anon: int | None  # smaps_rollup Pss_Anon (None on kernels without it)
    pss_file: int | None

    def as_mib(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"pid": self.pid}
        for field in dataclasses.fields(self):
            if field.name != "pid":
                value = getattr(self, field.name)
                out[f"{field.name}_mib"] = None if value is None else round(value / MIB, 1)
        return out


def _read_kb_fields(path: str) -> dict[str, int]:
    fields: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[key] = int(parts[0]) * 1024
    return fields


def read_memory(pid: int | str = "self") -> MemorySnapshot:
    """Memory of `pid` (default: this process). Raises PagelmError if /proc lacks it."""
    base = f"/proc/{pid}"
    try:
        status = _read_kb_fields(f"{base}/status")
        rollup = _read_kb_fields(f"{base}/smaps_rollup")
    except FileNotFoundError as e:
        raise PagelmError(f"no such process {pid} (/proc has no {e.filename})") from None
    except PermissionError as e:
        raise PagelmError(f"cannot read {e.filename}: permission denied") from None
    try:
        return MemorySnapshot(
            pid=os.getpid() if pid == "self" else int(pid),
            anonymous=rollup["Anonymous"],
            file_rss=status["RssFile"],
            rss=status["VmRSS"],
            peak_rss=status["VmHWM"],
            pss_anon=rollup.get("Pss_Anon"),
            pss_file=rollup.get("Pss_File"),
        )
    except KeyError as e:
        raise PagelmError(f"{base}: field {e.args[0]} missing (needs Linux >= 4.14)") from None
