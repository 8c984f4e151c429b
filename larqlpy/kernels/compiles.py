"""The kernels this process compiled, and the time it spent on them.

numba compiles a kernel on its first call with a new signature when its cache holds none
(`Dispatcher.compile` loads a cached overload first and fires `numba:compile` only around a real
compile), so a process on a warm cache sees no event here. A kernel's compile compiles the kernels
it calls inside it: only the outermost compile on a thread counts, so seconds are not counted twice.
A measured choice (kernels/weights/choice.py) is the same kind of once-per-machine work and counts
as one (`once`).

`watch()` installs the one listener (idempotent); `seconds()` is a monotonic total a caller takes
before and after a phase to leave the compiles inside it out of its time; `on_progress` hands each
outermost compile's start and end to a callback (the CLI's progress line).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from numba.core import config, event
from numba.core.caching import InTreeCacheLocator, UserProvidedCacheLocator, UserWideCacheLocator


@dataclass(frozen=True)
class Progress:
    """One outermost compile started (`seconds` None) or finished."""

    kernel: str  # readable: "qdot int4 vnni512"
    seconds: float | None
    count: int  # outermost compiles finished in this process, this one included
    total: float  # seconds of them


_lock = threading.Lock()
_local = threading.local()  # per thread: how deep in nested compiles, and when the outermost began
_totals = {"seconds": 0.0, "count": 0}
_callbacks: list[Callable[[Progress], None]] = []
_installed: list[bool] = []


def kernel_name(dispatcher) -> str:
    """A kernel's readable name: its module's last part and its own name, underscores as spaces."""
    fn = getattr(dispatcher, "py_func", None)
    if fn is None:
        return str(dispatcher)
    module = fn.__module__.rsplit(".", 1)[-1]
    return f"{module} {fn.__name__.strip('_').replace('_', ' ')}"


def _begin(name: str) -> None:
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth:
        return
    _local.t0 = time.perf_counter()
    _tell(Progress(name, None, *_snapshot()))


def _end(name: str) -> None:
    _local.depth -= 1
    if _local.depth:
        return
    took = time.perf_counter() - _local.t0
    with _lock:
        _totals["seconds"] += took
        _totals["count"] += 1
        count, total = _totals["count"], _totals["seconds"]
    _tell(Progress(name, took, count, total))


def _snapshot() -> tuple[int, float]:
    with _lock:
        return _totals["count"], _totals["seconds"]


def _tell(p: Progress) -> None:
    for cb in list(_callbacks):
        try:
            cb(p)
        except Exception:  # a progress display must never fail a compile
            pass


class _Listener(event.Listener):
    def on_start(self, ev):
        _begin(kernel_name(ev.data.get("dispatcher")) if isinstance(ev.data, dict) else "kernel")

    def on_end(self, ev):
        _end(kernel_name(ev.data.get("dispatcher")) if isinstance(ev.data, dict) else "kernel")


def watch() -> None:
    """Install the listener (once per process)."""
    with _lock:
        if _installed:
            return
        event.register("numba:compile", _Listener())
        _installed.append(True)


def seconds() -> float:
    """Seconds this process has spent compiling (and measuring choices) since `watch`, finished
    compiles only; monotonic."""
    return _snapshot()[1]


def count() -> int:
    """Outermost compiles (and choices measured) finished since `watch`."""
    return _snapshot()[0]


@contextmanager
def once(name: str) -> Iterator[None]:
    """Once-per-machine work other than a numba compile (a measured choice), counted as one beside
    the compiles inside it, which are heard on their own (its seconds are the rest of its time)."""
    if getattr(_local, "depth", 0):  # inside a compile: part of it
        yield
        return
    t0, inside = time.perf_counter(), seconds()
    try:
        yield
    finally:
        took = max(time.perf_counter() - t0 - (seconds() - inside), 0.0)
        with _lock:
            _totals["seconds"] += took
            _totals["count"] += 1
            count, total = _totals["count"], _totals["seconds"]
        _tell(Progress(name, took, count, total))


def announce(what: str) -> None:
    """Compiling begins elsewhere (a helper process): heard as a start, so a listener can say so
    before this process compiles anything itself."""
    _tell(Progress(what, None, *_snapshot()))


@contextmanager
def on_progress(callback: Callable[[Progress], None]) -> Iterator[None]:
    """`callback` hears each outermost compile start and finish while the block runs (on whichever
    thread compiles)."""
    watch()
    _callbacks.append(callback)
    try:
        yield
    finally:
        _callbacks.remove(callback)


def looks_cold() -> bool:
    """Whether no compiled decode attention (every run on the CPU compiles one) lies where numba
    caches it: read from the file system alone, so a command can say compiling is ahead before it
    reads a model or imports torch (kernels/ahead.py's `cold` asks numba's index, which needs the
    kernels imported). Stale files of an older source count as warm: the line then comes later, as
    the first compile starts."""
    source = str(Path(__file__).parent / "attention" / "decode.py")
    kinds = (UserProvidedCacheLocator,) if config.CACHE_DIR else (InTreeCacheLocator, UserWideCacheLocator)
    for kind in kinds:
        where = Path(kind(looks_cold, source).get_cache_path())
        if where.is_dir() and any(where.glob("decode._attend*.nbc")):
            return False
    return True


AHEAD_ENV = "LARQLPY_COMPILE_AHEAD"  # "0": no helper process (the tests' fixtures, a process that must stay alone)
EARLY = ("norms", "qkv")  # kernels/ahead.py's jobs that every model on the CPU runs, known before its file is read
_early: list[subprocess.Popen] = []


def begin_ahead() -> None:
    """On a cold cache, start kernels/ahead.py's helper process now, on the EARLY jobs, to hear the
    model's own jobs on its stdin once its header is read (`early_helper`): its imports and those
    compiles overlap this process reading the file (seconds on a large vocabulary). A run that never
    tells it (a GPU, a float model) ends it as it exits."""
    if _early or os.environ.get(AHEAD_ENV) == "0" or not looks_cold():
        return
    helper = subprocess.Popen([sys.executable, "-m", "larqlpy.kernels.ahead", "--more", *EARLY],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, AHEAD_ENV: "0"})
    atexit.register(end_helper, helper)
    _early.append(helper)


def early_helper() -> subprocess.Popen | None:
    """The helper `begin_ahead` started, while it still waits for its jobs (once only)."""
    if not _early or _early[0].stdin is None or _early[0].stdin.closed or _early[0].poll() is not None:
        return None
    return _early[0]


def end_helper(helper: subprocess.Popen) -> None:
    """Stop a helper as this process exits (numba writes a cache entry whole, by renaming)."""
    if helper.stdin is not None and not helper.stdin.closed:
        helper.stdin.close()
    if helper.poll() is None:
        helper.terminate()
        helper.wait()
