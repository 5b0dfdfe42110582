"""A pulled GGUF file's kernels compiled in a process of their own (`python -m pagelm.quant.precompile --types …`;
a pull imports no numba), so that the first run loads them: beside the download, from as soon as the file's
header has arrived, else once the file is there. A failure is a warning: that run compiles them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagelm.errors import PagelmError

FIRST_TRY = 64 << 10  # bytes of a download before its header is first parsed; then at each doubling


def _command(path, size: int | None = None) -> list[str]:
    """The compile command for the block types and head/embedding table types of the GGUF file at `path` (of
    `size` bytes when only its beginning is there yet)."""
    from pagelm.formats.gguf import GGUFFile
    from pagelm.quant.codecs import DECODABLE

    with GGUFFile.open(str(path), size) as model:
        tensors = model.tensors
    types = {t.ggml_type for t in tensors.values() if len(t.dims) >= 2 and t.ggml_type in DECODABLE}
    tables = {tensors[n].ggml_type for n in ("token_embd.weight", "output.weight") if n in tensors}
    return [sys.executable, "-m", "pagelm.quant.precompile", "--types", ",".join(sorted(t.name for t in types)),
            "--tables", ",".join(sorted(t.name for t in tables)), "--dtype", "bfloat16"]


class KernelsAhead:
    """One pulled file's kernels: `arrived` as its download grows (hub.pull's `on_bytes`), `finish` once it is
    stored."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self._next_try = FIRST_TRY

    def arrived(self, part: Path, have: int, size: int) -> None:
        """`have` of the `size` bytes of a GGUF download are in `part`: once its header parses, the compile starts."""
        if self.process is not None or have < min(self._next_try, size):
            return
        self._next_try = 2 * have
        try:
            command = _command(part, size)
        except (OSError, PagelmError):  # not all of the header yet (or not a GGUF file: finish says so)
            return
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def finish(self, path) -> None:
        """The file is at `path`: waits for the compile started beside its download, or runs it now."""
        if not str(path).lower().endswith(".gguf"):
            return
        try:
            process = self.process or subprocess.Popen(_command(path), stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.DEVNULL)
            failed = process.wait() != 0 and f"exit status {process.returncode}"
        except (OSError, PagelmError) as e:
            failed = str(e)
        if failed:
            print(f"pagelm pull: kernels not compiled ahead ({failed}); the first run compiles them", file=sys.stderr)
