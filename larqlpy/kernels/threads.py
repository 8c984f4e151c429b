"""How many threads the kernels run on: the CPUs this process may use (`os.sched_getaffinity`:
`taskset`, a container's cpuset), not the machine's count -- numba's own default counts every CPU,
and threads beyond the CPUs only wait on each other. A count the user gave (OMP_NUM_THREADS,
NUMBA_NUM_THREADS) is kept."""

from __future__ import annotations

import os

import numba
import torch


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def use_cores(n: int | None = None) -> int:
    """Run torch's and numba's threads on `n` CPUs (default: `cores()`); returns the count."""
    n = max(1, n or cores())
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(n)
    if "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return n
