"""One stderr line while kernels compile (numba found them missing from its cache): which block
types, how many kernels so far (of how many, where worker processes compile them: `announce`), and
at the end the time it took. Silent when every kernel loads from the cache: numba reports a
compilation only when it really compiles. Compiles nothing itself."""

from __future__ import annotations

import sys
import threading
import time

from numba.core import event

from pagelm.quant.types import GGMLType

_TYPE_NAMES = {t.name for t in GGMLType}


def _block_type(dispatcher) -> str | None:
    """The GGML type a per-type kernel is named after (codegen.kernel_of appends it), else None."""
    name = dispatcher.py_func.__name__
    return next((t for t in sorted(_TYPE_NAMES, key=len, reverse=True) if name.endswith(f"_{t}")), None)


class CompileProgress(event.Listener):
    """`with CompileProgress():` reports the kernels compiled inside the block on `stream`. On a
    terminal the line counts up in place (unless `live` is False); elsewhere (a log) it is written when compiling
    starts and once more when the block ends. `status()` is the line's text, None until a kernel compiles."""

    def __init__(self, stream=None, live: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.compiled = 0
        self.total: int | None = None  # the kernel functions worker processes compile (precompile.compile_missing)
        self.types: list[str] = []
        self._depth = 0  # a kernel's callees compile inside it: count the outermost only
        self._started: float | None = None
        self._lock = threading.Lock()
        self._live = getattr(self.stream, "isatty", lambda: False)() if live is None else live

    def status(self) -> str | None:
        if self._started is None:
            return None
        count = f"{self.compiled} of {self.total}" if self.total and self.compiled <= self.total else f"{self.compiled}"
        return f"compiling kernels{self._for_types()} (first run only): {count} compiled …"

    def _for_types(self) -> str:
        return f" for {', '.join(self.types)}" if self.types else ""

    def on_start(self, ev) -> None:
        with self._lock:
            self._begin([_block_type(ev.data["dispatcher"])])
            self._depth += 1

    def _begin(self, kinds) -> None:
        for kind in kinds:
            if kind is not None and kind not in self.types:
                self.types.append(kind)
        if self._started is None:
            self._started = time.perf_counter()
            self._write(self.status() if self._live else f"compiling kernels{self._for_types()} (first run only) …",
                        final=not self._live)

    def on_end(self, ev) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._count()

    def _count(self) -> None:
        self.compiled += 1
        if self._live:
            self._write(self.status(), final=False)

    def workers_compile(self, kinds: list[str], total: int):
        """`total` kernel functions of `kinds` compiling in worker processes: a function to call as each is done."""
        with self._lock:
            self.total = total
            self._begin(kinds)

        def done() -> None:
            with self._lock:
                self._count()

        return done

    def _write(self, line: str, final: bool) -> None:
        self.stream.write(("\r\033[K" if self._live else "") + line + ("\n" if final else ""))
        self.stream.flush()

    def __enter__(self) -> CompileProgress:
        event.register("numba:compile", self)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        event.unregister("numba:compile", self)
        _ACTIVE.remove(self)
        if self._started is not None:
            self._write(f"compiled {self.compiled} kernels{self._for_types()} in {time.perf_counter() - self._started:.1f} s "
                        "(cached for the next run)", final=True)


_ACTIVE: list[CompileProgress] = []  # the blocks open now, innermost last


def announce(kinds: list[str], total: int):
    """Tells the open CompileProgress blocks that `total` kernel functions of `kinds` compile elsewhere (worker
    processes, where their numba events do not reach); returns the function to call as each is done."""
    counters = [p.workers_compile(kinds, total) for p in _ACTIVE]

    def done() -> None:
        for count in counters:
            count()

    return done
