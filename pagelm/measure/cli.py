"""The `pagelm mem` command: a process's memory from /proc, as text or JSON."""

from __future__ import annotations

import argparse
import json

def _mem(args: argparse.Namespace) -> int:
    """Read a process's memory from /proc: anonymous (what unpacked weights cost), file-backed RSS (mapped
    model pages), RSS, peak RSS (VmHWM), PSS."""
    from pagelm.measure.memory import read_memory

    snapshot = read_memory(args.pid if args.pid is not None else "self")
    figures = snapshot.as_mib()
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"pid {snapshot.pid}")
    for key, value in figures.items():
        if key != "pid":
            label = key.removesuffix("_mib").replace("_", " ")
            print(f"{label:>10}: {'n/a' if value is None else f'{value:.1f} MiB'}")
    return 0


def register(commands) -> None:
    mem = commands.add_parser(
        "mem", help="anonymous, file-backed, total and peak resident memory of a process",
        description=_mem.__doc__)
    mem.add_argument("--pid", type=int, help="process to measure (default: this one)")
    mem.add_argument("--json", action="store_true", help="print one JSON object (MiB)")
    mem.set_defaults(run=_mem)
