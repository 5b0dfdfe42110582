"""Files that several `pagelm` processes write at once: JSON records (what `pull` chose, the local
models) read and rewritten under a lock, and anything put in place through a temporary name of
its own, so that two processes never write one temporary file and a reader never sees half of one.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """A name beside `path` that no other process (nor another call here) uses."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_atomically(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before, never a part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_record(path: Path) -> dict:
    """The JSON object in `path`; empty when there is none or it is not an object."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


@contextmanager
def updating(path: Path) -> Iterator[dict]:
    """The record in `path`, to change in place: written back when the block ends, with every other
    update of it waiting meanwhile (so none is lost)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
        entries = read_record(path)
        yield entries
        write_atomically(path, json.dumps(entries, indent=1, sort_keys=True))
