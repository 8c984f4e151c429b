"""Whether other work already runs on the CPUs this process will use, and the thread pools' way of
waiting that follows from it (no torch, no numba: decided before either starts its threads).

The kernels' threads (one OpenMP runtime serves torch and numba here) spin after every parallel
region, waiting for the next one. On a quiet machine that makes each of the many small regions of
a decode step start at once; beside another busy process the spinning threads take the CPU from
the threads doing the work, and throughput collapses where sleeping threads lose nothing
(docs/batch.md has the figures). So a process that starts beside
other runnable work waits by sleeping (OMP_WAIT_POLICY=PASSIVE); one that starts on a quiet
machine spins. The choice is made once, at start: OpenMP reads it when it starts its threads.
"""

from __future__ import annotations

import os
import time

SAMPLES, GAP_S = 3, 0.004  # the kernel's count of runnable tasks, read a few times apart (its minimum)
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def runnable() -> int:
    """Runnable tasks on the machine now, this process's among them (/proc/loadavg's running field)."""
    with open("/proc/loadavg", "rb") as f:
        return int(f.read().split()[3].split(b"/")[0])


def outside_affinity() -> int:
    """The machine's CPUs this process may not use."""
    return (os.cpu_count() or 1) - len(os.sched_getaffinity(0))


def others_runnable() -> int:
    """Runnable tasks beside this process, as the kernel counts them now (fewest of a few readings:
    a busy process is always there, a passing one is not)."""
    seen = []
    for i in range(SAMPLES):
        seen.append(runnable() - 1)  # this process itself is running
        if i + 1 < SAMPLES:
            time.sleep(GAP_S)
    return max(0, min(seen))


def own_running() -> int:
    """This process's threads the kernel counts as runnable now (its spinning workers among them)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        n += stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R"
    return n


def running_outside() -> int:
    """CPUs other runnable work takes from those this process may use, now (one reading): the
    kernel's count of runnable tasks less this process's own, less the machine's CPUs outside its
    affinity. 0 where /proc cannot tell (not Linux)."""
    try:
        return max(0, runnable() - max(1, own_running()) - outside_affinity())
    except (OSError, ValueError, IndexError):
        return 0


def contended() -> bool:
    """Whether other runnable work must share the CPUs this process may use: more of it than the
    machine has CPUs outside them."""
    try:
        return others_runnable() > outside_affinity()
    except (OSError, ValueError, IndexError):  # no /proc (not Linux): as if quiet
        return False


def choose_waits(environ=os.environ) -> str | None:
    """Set OMP_WAIT_POLICY=PASSIVE when the machine is contended and the user set no wait policy;
    returns what was set (None: nothing)."""
    if any(k in environ for k in WAIT_SETTINGS) or not contended():
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
