"""Kernels a run of a GGUF file will need, compiled ahead in a second process while the run works.

numba compiles a kernel on its first call and, in one process, one kernel at a time (its compiler
lock, under the GIL), so a run on a cold cache compiled a dozen kernels one after another on one core
while the other waited. A command that finds the cache cold starts this module as a helper process
at once (compiles.begin_ahead: the kernels every CPU run needs, while the command reads the model's
header), and tells it the model's own once it knows them (`start`, else a helper starts then): it
calls each kernel the run will reach last, first (`plan`), once, on tiny arrays
of the types the run passes, so numba compiles it with the run's own signature into the same cache
(NUMBA_CACHE_DIR, else beside the sources). When the run reaches a kernel the helper has saved, numba
loads it from the cache instead of compiling it; the two meet about halfway. The helper compiles the
same source as the run would, so the run computes the same bits either way: nothing switches
mid-run. It stops at the first kernel it finds cached (the run has been there), and the run ends it
when it exits (numba writes a cache entry whole, by renaming, so none is left half-written).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from typing import Callable, Iterable

import torch

from larqlpy.kernels import compiles
from larqlpy.kernels.attention import decode
from larqlpy.kernels.attention.rowdots import HEAD_DIMS
from larqlpy.kernels.weights import matvec
from larqlpy.kernels.weights.gguf_blocks import HALF_SCALES, LAYOUTS, packed_width, tiled_arrays
from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.kernels.weights.simd import ROWS as TILE
from larqlpy.kernels.weights.simd import layout_bits

_helpers: list[subprocess.Popen] = []
ENV = compiles.AHEAD_ENV
K, HEADS, KV, D = 256, 2, 1, 64  # tiny shapes: a kernel's signature holds dtypes and layouts, not sizes
OTHER_HEAD = 80  # a head size outside rowdots.HEAD_DIMS: their one kernel


def _product(qtype: str) -> None:
    """The integer product this type's codes run, on this CPU's path, as the loader packs them."""
    _, _, _, _, zero, affine = LAYOUTS[qtype]
    bits, base = packed_width(qtype)
    codes, scale, minimum, outer, _ = tiled_arrays(qtype, TILE, K)
    w = PackedWeight.from_tiled(codes, (TILE, K), scale, minimum if affine else None, zero - base, bits, 0,
                                (1 << layout_bits(bits)) - 1, halves=qtype in HALF_SCALES, outer=outer)
    w.matmul(torch.zeros(1, K))


def _norms() -> None:
    x, w = torch.zeros(1, K), torch.ones(K)
    matvec.rms_norm(x, w, 1e-6, 0.0)
    matvec.residual_norm(x, x, None, w, 1e-6, 0.0)
    matvec.gated(torch.zeros(1, 2 * K), "silu")


def _qkv() -> None:
    cos = torch.ones(1, D)
    matvec.qkv_rope(torch.zeros(1, (HEADS + 2 * KV) * D), torch.zeros((HEADS + 2 * KV) * D), HEADS, KV, None, None,
                    1e-6, 0.0, cos, cos)


def _attend(d: int) -> None:
    """A decode step's attention over one short chunk, the step's own row written by the kernel, at
    head size d (each of rowdots.HEAD_DIMS has its own kernel, every other size one)."""
    k, v = torch.zeros(KV, 4, d), torch.zeros(KV, 4, d)
    new = torch.zeros(KV, 1, d)
    decode.attend_rows(torch.zeros(1, HEADS, d), [decode.Span(k, v, 0, 1, write=True)], 0.125, new=(new, new),
                       cols=[0])


def jobs() -> dict[str, Callable[[], None]]:
    """Every job by name: `product Q8_0`, `norms`, `qkv`, `attend 64` (a head size of
    rowdots.HEAD_DIMS, or `attend other`)."""
    out: dict[str, Callable[[], None]] = {"norms": _norms, "qkv": _qkv, "attend other": lambda: _attend(OTHER_HEAD)}
    for d in HEAD_DIMS:
        out[f"attend {d}"] = lambda d=d: _attend(d)
    for qtype in LAYOUTS:
        out[f"product {qtype}"] = lambda q=qtype: _product(q)
    return out


def plan(qtypes: Iterable[str], head: int = D) -> list[str]:
    """The helper's jobs for a GGUF whose quantized matrices have these types in load order (`head`:
    its attention's head size): the kernels the run reaches last first. Not the block repackers: the
    run needs them within seconds of starting, before the helper could have one ready (it would
    compile the same one beside the run); an embedding's rows need none (gguf_blocks.BlockRows)."""
    types = list(dict.fromkeys(q for q in qtypes if q in LAYOUTS))
    if not types:
        return []
    attend = f"attend {head}" if head in HEAD_DIMS else "attend other"
    return [attend, "norms", "qkv", *(f"product {q}" for q in reversed(types))]


def cold() -> bool:
    """Whether numba's cache holds no decode attention kernel, which every run on the CPU compiles: a
    fresh machine or cache. (Its index file alone says nothing: jitcache.tie writes it empty.)"""
    try:
        return not any(k._cache._cache_file._load_index() for k in decode.ONE_CHUNK.values())
    except AttributeError:  # another numba's insides: no helper, as before
        return False


def start(names: list[str]) -> subprocess.Popen | None:
    """Have a helper compile `names` when the cache is cold: the one the command began early
    (compiles.begin_ahead), told them on its stdin, else a new one; ended when this process exits."""
    early = compiles.early_helper()
    if not names or os.environ.get(ENV) == "0" or not cold():
        if early is not None:
            early.stdin.close()  # nothing more for it: it ends after its early jobs
        return None
    if early is not None:
        try:
            early.stdin.write("".join(f"{n}\n" for n in names).encode() + b"\n")  # a blank line ends them
            early.stdin.close()
            _helpers.append(early)
            return early
        except OSError:  # it has gone: start another
            pass
    helper = subprocess.Popen([sys.executable, "-m", __name__, *names], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, ENV: "0"})
    atexit.register(compiles.end_helper, helper)
    _helpers.append(helper)
    compiles.announce(f"{len(names)} groups of kernels ahead, in a second process")
    return helper


def started() -> bool:
    """Whether this process has started a helper."""
    return bool(_helpers)


def busy() -> bool:
    """Whether a helper this process started is still compiling (on the other core: a measurement
    now would time it too)."""
    return any(h.poll() is None for h in _helpers)


def run(names: list[str], tell: Callable[[str, float], None] | None = None) -> list[tuple[str, float]]:
    """Compile `names` in order, each's seconds (told as each ends); stops at the first that
    compiled nothing (the run got there first: the rest it has passed too)."""
    compiles.watch()
    table, done = jobs(), []
    for name in names:
        t0, before = time.perf_counter(), compiles.count()
        table[name]()
        done.append((name, time.perf_counter() - t0))
        if tell is not None:
            tell(*done[-1])
        if compiles.count() == before:
            break
    return done


def _say(job: str, took: float) -> None:
    print(f"{job}: {took:.1f} s", flush=True)


if __name__ == "__main__":
    more = sys.argv[1:2] == ["--more"]  # then the model's own jobs on stdin, once its header is read
    first = sys.argv[2:] if more else sys.argv[1:]
    run(first, _say)
    if more:
        # to a blank line, not to the end: a child this process's parent forks holds the pipe open
        later = list(iter(lambda: sys.stdin.readline().strip(), ""))
        run([n for n in later if n not in first], _say)
