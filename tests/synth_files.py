"""Synthetic model files for tests, written by `pagelm synth` in a process of its own (as a user writes them)."""

import subprocess
import sys


def synth(path, shape: str, *extra: str) -> str:
    """Writes `pagelm synth --shape SHAPE EXTRA… PATH`; returns the path."""
    subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", shape, "--quiet", *extra, str(path)],
                   check=True, capture_output=True)
    return str(path)
