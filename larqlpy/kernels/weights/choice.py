"""Kernel choices no feature flag can make, measured once per machine and kept.

The numba f32 GEMV streamed the 270M's LM head faster than torch's on an AVX2 EPYC and slower on a
Sapphire Rapids Xeon with the same instruction sets (docs/benchmarks.md): which one wins is a
property of the machine, so
the first product of each shape times both (a few runs each, alternating) and the winner is stored
in ~/.cache/larqlpy/kernel-choices.json under this CPU's features. Not under the thread count: the
candidates round differently, so a choice that followed the count would give a 1-thread and a
2-thread process (or one whose count follows the load) different numbers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from larqlpy.files import atomic_path
from larqlpy.kernels import compiles, cpu

_memo: dict[str, str] = {}


def _file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "larqlpy" / "kernel-choices.json"


def _machine() -> str:
    return cpu.describe()


def _stored() -> dict:
    try:
        data = json.loads(_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _measure(candidates: dict[str, Callable[[], object]], runs: int) -> str:
    best = {name: float("inf") for name in candidates}
    for fn in candidates.values():  # warm: compile, page in
        fn()
    for _ in range(runs):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.get)


def choose(what: str, candidates: dict[str, Callable[[], object]], runs: int = 5) -> str:
    """The fastest of `candidates` (name -> a call doing the work) for `what`, measured on first use
    on this machine and remembered (in this process and on disk)."""
    key = f"{_machine()} | {what}"
    if key in _memo:
        return _memo[key]
    known = _stored().get(key)
    if known in candidates:
        _memo[key] = known
        return known
    with compiles.once(f"measured {what}"):  # once per machine, as a compile is: not a phase's own time
        winner = _measure(candidates, runs)
    _memo[key] = winner
    try:
        data = _stored()
        data[key] = winner
        _file().parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(_file()) as tmp:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    except OSError:  # a read-only home costs the memory of it, not the run
        pass
    return winner
