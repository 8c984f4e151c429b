"""Work handed out in chunks from a shared counter, so that whichever thread is free takes the next.

numba's threading layers split a prange's range once, one block per thread (the omp layer, which
this venv's torch shares: `omp for` without a schedule, static; workqueue: total / threads). Beside
another busy process, a thread that loses its core for a time slice holds its whole block up
while its partner waits at the region's end. A kernel that runs `for _ in prange(slots)` and
takes its chunks with `take` until they run out (`slots`: one prange iteration per thread of the
pool; where fewer threads run, a thread's extra iterations find none left) gives the free thread
the rest: a descheduled one
delays the region by the one chunk it holds (ggml's CPU products do the same). Each chunk's outputs
are that chunk's work alone, so the bits are the same whichever thread takes it and in whatever
order, at any thread count (tests/test_thread_bits.py).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _fetch_add(typingctx, counter):
    """counter[0] += 1, atomically; the value before."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


@njit(inline="always", cache=True)
def counter():  # pragma: no cover - jitted
    """A region's shared count of chunks taken."""
    return np.zeros(1, np.int64)


@njit(inline="always", cache=True)
def take(count):  # pragma: no cover - jitted
    """The next chunk's index (past the last: none left)."""
    return _fetch_add(count)


def slots() -> int:
    """A region's prange iterations: the pool's threads (numba.get_num_threads() would say how many
    run now, but costs microseconds a call, in jitted code too, and keeps a kernel out of the cache)."""
    return numba.config.NUMBA_NUM_THREADS
