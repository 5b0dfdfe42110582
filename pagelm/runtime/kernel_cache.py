"""Where the compiled kernels live: a per-user cache outside the install, and reading it so that a
damaged or foreign entry is compiled again, never a crash. Imports numba only to guard its reads.

numba's own index already keys each entry by numba's version, the source file's content, the
signature and the CPU (name and features); the directory adds what it does not hold: pagelm's,
llvmlite's and Python's versions, so an upgrade starts a directory of its own beside the old one.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path


def root() -> Path:
    """$PAGELM_CACHE, else the user's cache directory's pagelm/kernels ($XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("PAGELM_CACHE"):
        return Path(os.environ["PAGELM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagelm" / "kernels"


def _installed_version(package: str) -> str:
    """`package`'s version from its dist-info beside it, without importing it (importlib.metadata
    costs ~25 ms, which every `pagelm --help` would pay)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return "none"
    site = os.path.dirname(os.path.dirname(spec.origin))
    found = glob.glob(os.path.join(glob.escape(site), f"{package}-*.dist-info"))
    return os.path.basename(found[0])[len(package) + 1:-len(".dist-info")] if len(found) == 1 else "unknown"


def directory(pagelm_version: str) -> Path:
    """This install's directory in the cache: root()/pagelm-V-numba-V-llvmlite-V-pyXY."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root() / (f"pagelm-{pagelm_version}-numba-{_installed_version('numba')}"
                     f"-llvmlite-{_installed_version('llvmlite')}-{python}")


def configure(pagelm_version: str) -> None:
    """Point numba's cache at directory(pagelm_version), unless the user set NUMBA_CACHE_DIR; numba reads it once,
    at its import, so this runs when pagelm is imported."""
    if "NUMBA_CACHE_DIR" not in os.environ and "numba" not in sys.modules:
        os.environ["NUMBA_CACHE_DIR"] = str(directory(pagelm_version))


def tolerate_damaged_entries() -> None:
    """Makes numba treat an index or data file it cannot read (truncated, overwritten, written by
    something else) as a miss: the kernel is compiled again and the entry rewritten. numba itself
    raises from inside the call that needed the kernel."""
    from numba.core import caching

    if getattr(caching.Cache.load_overload, "tolerates_damage", False):
        return
    load_overload, load_index = caching.Cache.load_overload, caching.IndexDataCacheFile._load_index

    def load_overload_or_miss(self, sig, target_context):
        try:
            return load_overload(self, sig, target_context)
        except Exception:  # noqa: BLE001 - any unreadable entry is a miss
            return None

    def load_index_or_empty(self):
        try:
            return load_index(self)
        except Exception:  # noqa: BLE001 - an unreadable index is rewritten by the next save
            return {}

    load_overload_or_miss.tolerates_damage = True
    caching.Cache.load_overload = load_overload_or_miss
    caching.IndexDataCacheFile._load_index = load_index_or_empty
