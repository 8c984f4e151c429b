"""Each kernel's compile on a fresh numba cache, in CPU seconds of the compiling thread, and where
they go: LLVM (every call into llvmlite's library: parsing, linking, optimizing, machine code) and
numba's own passes (type inference, parfor conversion, lowering), each counted where it runs, not
again in the pass around it. A job runs in its own process over its own empty NUMBA_CACHE_DIR
(imports are left out), calling the kernels as a run would on tiny arrays (kernels/ahead.py's jobs,
and `tiled QTYPE`: the block repacker a GGUF's load runs). CPU seconds, not wall: other processes
on the machine slow a wall clock more than they do these. Asserts nothing.

    python bench/compile_cost.py [-v] ["tiled Q4_K,Q8_0" "product Q4_K" attend ...]   (-v: by function too)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from numba.core import event

from larqlpy.kernels import ahead
from larqlpy.kernels.weights.gguf_blocks import LAYOUTS, packed_width, tiled_arrays, unpack_tiled
from larqlpy.kernels.weights.simd import ROWS

ROOT = Path(__file__).resolve().parent.parent
# The kernels a Q4_K_M GGUF's run compiles (qwen2.5-coder-0.5b-instruct: Q4_K, Q6_K, Q5_0, Q8_0).
DEFAULT = ["tiled Q4_K,Q6_K,Q8_0,Q5_0", "product Q8_0", "product Q5_0", "product Q6_K",
           "product Q4_K", "norms", "qkv", "attend"]


def _tiled(qtypes: str) -> None:
    """The block repacker on each of these types (Q4_K,Q8_0: one after the other, as a load does)."""
    for qtype in qtypes.split(","):
        size, per, *_ = LAYOUTS[qtype]
        k = 256
        codes, scale, minimum, outer, seen = tiled_arrays(qtype, ROWS, k)
        raw = np.zeros((ROWS, k // per * size), np.uint8)
        unpack_tiled(raw, qtype, (ROWS, k), np.arange(ROWS), 0, codes, scale, minimum, seen, packed_width(qtype),
                     outer)


class _Clock:
    """CPU seconds of this thread, charged to the innermost pass or LLVM call running, and to the
    function it compiles."""

    def __init__(self):
        self.stack, self.last = [("python", "")], time.thread_time()
        self.spent, self.functions = Counter(), Counter()

    def _tick(self) -> None:
        now = time.thread_time()
        label, function = self.stack[-1]
        self.spent[label] += now - self.last
        self.functions[function] += now - self.last
        self.last = now

    def enter(self, label: str, function: str | None = None) -> None:
        self._tick()
        self.stack.append((label, self.stack[-1][1] if function is None else function))

    def leave(self) -> None:
        self._tick()
        self.stack.pop()


def one(job: str) -> dict:
    """Run one job in this process; its CPU seconds, in all and by pass."""
    table = ahead.jobs()
    call = (lambda: _tiled(job.split()[1])) if job.startswith("tiled ") else table.get(job) or table[f"{job} 64"]
    clock = _Clock()

    class Passes(event.Listener):
        def on_start(self, ev):
            clock.enter(ev.data["name"].split(" [")[0], ev.data["qualname"])

        def on_end(self, ev):
            clock.leave()

    class Llvm(event.Listener):
        def on_start(self, ev):
            clock.enter("llvm")

        def on_end(self, ev):
            clock.leave()

    event.register("numba:run_pass", Passes())
    event.register("numba:llvm_lock", Llvm())
    t0, w0 = time.process_time(), time.perf_counter()
    call()
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    clock._tick()
    return {"job": job, "cpu": cpu, "wall": wall, "passes": dict(clock.spent.most_common()),
            "functions": dict(clock.functions.most_common())}


def main(jobs: list[str], verbose: bool) -> None:
    print(f"{'job':24} {'CPU s':>6} {'wall s':>7} {'LLVM':>6}  numba's passes (CPU s)")
    for job in jobs:
        with tempfile.TemporaryDirectory(prefix="compile-cost-") as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache, "LARQLPY_COMPILE_AHEAD": "0",
                   "PYTHONPATH": str(ROOT)}
            out = subprocess.run([sys.executable, __file__, "--one", job], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{job}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.splitlines()[-1])
        passes = dict(r["passes"])
        llvm = passes.pop("llvm", 0.0)
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(passes.items())[:4])
        print(f"{job:24} {r['cpu']:6.2f} {r['wall']:7.2f} {llvm:6.2f}  {top}", flush=True)
        if verbose:
            print("    by function: " + ", ".join(f"{k or '-'} {v:.2f}" for k, v in list(r["functions"].items())[:6]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2])))
    else:
        args = [a for a in sys.argv[1:] if a != "-v"]
        main(args or DEFAULT, "-v" in sys.argv[1:])
