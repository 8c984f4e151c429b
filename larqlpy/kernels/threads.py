"""How many threads the kernels run on: the CPUs this process may use (`os.sched_getaffinity`:
`taskset`, a container's cpuset), not the machine's count -- numba's own default counts every CPU,
and threads beyond the CPUs only wait on each other. A count the user gave (OMP_NUM_THREADS,
NUMBA_NUM_THREADS) is kept.

While a process runs, `LoadFollower` lowers that count by the CPUs other runnable work takes, and
raises it again when they are free. Every parallel region ends at a barrier: with one of two cores
taken by another process, a spinning thread sharing that core is descheduled for whole time slices
while its partner waits, and a decode step of a hundred regions runs at a tenth of its speed. One
thread on the free core keeps about half of a memory-bound step (docs/benchmarks.md has the
figures). No numba kernel's number depends on the count (each output is one thread's whole work),
and the chosen kernels (kernels/weights/choice.py) are keyed on the CPU, not on a thread count.
torch's own float32 GEMM (MKL) still splits by thread count: MKL's strict reproducible mode
(MKL_CBWR=AUTO,STRICT) would fix that, but it made a kept state's answer part from a whole
prefill's (tests/test_serve_responses.py), so it is left to the user (docs/weights.md).
"""

from __future__ import annotations

import os
import time

import numba
import torch

from larqlpy.kernels.contention import running_outside

_planned: int | None = None


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def use_cores(n: int | None = None) -> int:
    """Run torch's and numba's threads on `n` CPUs (default: `cores()`, or the counts the environment
    fixed); returns the count. A count given here wins over the environment's: Ray sets
    OMP_NUM_THREADS in its workers after torch has read it, so a 1-CPU replica ran torch on every CPU."""
    global _planned
    given = n is not None
    n = max(1, n or cores())
    if given or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(n)
    numba.set_num_threads(_numba_count(n))
    _planned = torch.get_num_threads()
    return n


def _numba_count(n: int) -> int:
    """numba's threads for `n` planned: within its pool (NUMBA_NUM_THREADS, where the user set one)."""
    return min(n, numba.config.NUMBA_NUM_THREADS)


def planned() -> int:
    """The thread count this process was set up with (`use_cores`, or torch's when first asked),
    whatever the load made of it since."""
    global _planned
    if _planned is None:
        _planned = torch.get_num_threads()
    return _planned


def pinned() -> bool:
    """Whether the user fixed the thread counts (or asked us not to follow the load)."""
    return any(k in os.environ for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")) or \
        os.environ.get("LARQLPY_FOLLOW_LOAD", "1") == "0"


def sleeping() -> bool:
    """Whether the threads sleep between regions (OMP_WAIT_POLICY=PASSIVE, which contention.py sets
    for a process that starts beside other work)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


class LoadFollower:
    """The kernels' thread count on the thread that runs the model, following the load: the planned
    count less the CPUs other runnable work takes, at least 1. Called before each step; it reads the
    load every EVERY_S (about 40 us a reading). It gives threads up at the second reading in a row
    that finds the CPUs taken, and takes them back at the BACK-th that finds them free: a passing
    task moves nothing, and a slow return costs less than a collapse."""

    EVERY_S, BACK = 0.05, 3

    def __init__(self, on: bool = True):
        self.most = planned()
        self.now = 0  # not yet set on the stepping thread (an earlier follower may have left fewer)
        self.cpu = on
        self.on = on and not pinned() and self.most > 1
        self.sleeping = sleeping()
        self.next_at, self.lower, self.higher = 0.0, 0, 0

    def __call__(self) -> int:
        """Apply the count the load asks for now; returns the count in force. The first call sets the
        planned count on the stepping thread even where the load is not followed: numba's count is
        each thread's own, and a thread that never set it runs every CPU (a server's engine thread,
        a 1-CPU Ray replica's: two such replicas' spinning second threads took a 2-core machine)."""
        if not self.cpu:
            return self.most
        if not self.now:
            self.set(self.most)
        if not self.on:
            return self.now
        t = time.monotonic()
        if t < self.next_at:
            return self.now
        self.next_at = t + self.EVERY_S
        want = self.wanted(running_outside())
        self.lower = self.lower + 1 if want < self.now else 0
        self.higher = self.higher + 1 if want > self.now else 0
        if self.lower >= 2 or self.higher >= self.BACK:
            self.set(want)
        return self.now

    def wanted(self, others: int) -> int:
        """The count for `others` CPUs taken: those left, at least 1. Where every CPU is taken and
        the threads sleep between regions, all of them: each runnable thread gets its fair share, so
        more threads get more of the CPUs, and a sleeping one holds no partner up (beside two busy
        loops on two cores, two sleeping threads decode faster than one; docs/benchmarks.md)."""
        if others >= self.most and self.sleeping:
            return self.most
        return max(1, self.most - others)

    def set(self, n: int) -> None:
        self.now, self.lower, self.higher = n, 0, 0
        torch.set_num_threads(n)
        numba.set_num_threads(_numba_count(n))
