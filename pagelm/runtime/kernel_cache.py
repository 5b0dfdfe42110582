"""Where the compiled kernels live: a per-user cache outside the install, and reading it so that a
damaged or foreign entry is compiled again, never a crash. Imports numba only to guard its reads.

numba's own index already keys each entry by numba's version, the source file's content, the
signature and the CPU (name and features); the directory adds what it does not hold: pagelm's,
llvmlite's and Python's versions, so an upgrade starts a directory of its own beside the old one.
Inside it each pagelm module's kernels go under the module's path in the package (`PackageLocator`),
where numba would name a folder after the absolute path of the source: a second virtualenv, a
reinstall or a copy of the same sources finds them.
"""

from __future__ import annotations

import functools
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
    """Point numba's cache at directory(pagelm_version), unless the user set NUMBA_CACHE_DIR, and have pagelm's
    modules located there by PackageLocator (numba's own locators after it, for everything else, unless the
    user chose locators); numba reads both at its import, so this runs when pagelm is imported, and has numba read
    them again where it was imported first."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(directory(pagelm_version)))
    os.environ.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", f"{__name__}.PackageLocator," + ",".join(_NUMBA_LOCATORS))
    if "numba" in sys.modules:
        from numba.core import config

        config.reload_config()


# numba's locators in its own order (numba.core.caching._CacheImpl._locator_classes)
_NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator", "IPythonCacheLocator",
                   "ZipCacheLocator")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pagelm/


def __getattr__(name: str):
    if name == "PackageLocator":  # made when numba first asks for it, so that importing this module imports no numba
        return _package_locator()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _package_locator() -> type:
    from numba.core import caching, config

    class PackageLocator(caching.UserProvidedCacheLocator):
        """The kernels of a pagelm module under NUMBA_CACHE_DIR/pagelm/<its folder in the package>; numba's
        stamp of an entry is already the hash of the source's content, not its path or time."""

        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            inside = os.path.relpath(os.path.dirname(os.path.abspath(py_file)), os.path.dirname(_PACKAGE))
            self._cache_path = os.path.join(config.CACHE_DIR, inside)

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.commonpath([_PACKAGE, os.path.abspath(py_file)]) != _PACKAGE:
                return None
            return super().from_function(py_func, py_file)

    return PackageLocator


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
