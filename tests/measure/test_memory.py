"""pagelm.measure.memory against real allocations and a real file map in this process."""

import mmap
import subprocess
import sys

import numpy as np
import pytest

from pagelm.errors import PagelmError
from pagelm.measure.memory import MIB, read_memory


def test_figures_are_consistent():
    m = read_memory()
    assert m.anonymous > 0 and m.rss > 0
    assert m.rss >= m.file_rss
    assert m.peak_rss >= m.rss


def test_anonymous_grows_with_a_touched_buffer():
    # a fresh process: in this one, earlier tests may have left free heap that malloc would reuse
    script = (
        "import numpy as np; from pagelm.measure.memory import read_memory, MIB\n"
        "before = read_memory().anonymous\n"
        "buffer = np.ones(64 * MIB, np.uint8)  # ones() writes every page\n"
        "print((read_memory().anonymous - before) // MIB)\n"
    )
    grown = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout)
    assert grown >= 60


def test_mapped_file_pages_are_file_backed_not_anonymous(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 64 * MIB, np.uint8).tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        before = read_memory()
        view = np.frombuffer(m, np.uint8)
        checksum = int(view[:: mmap.PAGESIZE].sum())  # touch one byte per page
        after = read_memory()
        del view
    assert checksum > 0
    assert after.file_rss - before.file_rss >= 60 * MIB
    assert after.anonymous - before.anonymous < 8 * MIB


def test_unknown_process_is_a_pagelm_error():
    with pytest.raises(PagelmError, match="no such process"):
        read_memory(2**22 + 12345)


def test_as_mib_names_every_figure():
    figures = read_memory().as_mib()
    assert {"anonymous_mib", "file_rss_mib", "rss_mib", "peak_rss_mib"} <= figures.keys()
