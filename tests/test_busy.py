"""The kernels' thread count follows the load while a process runs (kernels/threads.LoadFollower):
it gives threads up when other work takes CPUs, takes them back when they are free, and no number
changes with it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numba
import pytest
import torch

from conftest import smol_gguf
from larqlpy.kernels import contention, threads


@pytest.fixture
def counts():
    """Leave torch's and numba's thread counts as they were."""
    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def _fake_load(monkeypatch, readings):
    seq = iter(readings)
    monkeypatch.setattr(threads, "running_outside", lambda: next(seq))
    monkeypatch.setattr(threads.LoadFollower, "EVERY_S", 0.0)
    for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "LARQLPY_FOLLOW_LOAD", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(k, raising=False)


def test_threads_given_up_at_the_second_busy_reading_and_taken_back_at_the_third_quiet(monkeypatch, counts):
    monkeypatch.setattr(threads, "_planned", 2)
    _fake_load(monkeypatch, [0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0])
    follow = threads.LoadFollower()
    seen = [follow() for _ in range(13)]
    assert seen == [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 2, 2]
    assert torch.get_num_threads() == 2 and numba.get_num_threads() == 2
    follow.set(1)
    assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1


def test_a_count_the_user_fixed_is_kept_and_sleeping_threads_keep_their_share(monkeypatch, counts):
    monkeypatch.setattr(threads, "_planned", 2)
    _fake_load(monkeypatch, [1] * 5)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [threads.LoadFollower()() for _ in range(3)] == [2, 2, 2]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LARQLPY_FOLLOW_LOAD", "0")
    assert not threads.LoadFollower().on
    monkeypatch.delenv("LARQLPY_FOLLOW_LOAD")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # sleeping threads beside a full machine keep their share
    follow = threads.LoadFollower()
    assert [follow.wanted(n) for n in (0, 1, 2, 3)] == [2, 1, 2, 2]
    monkeypatch.delenv("OMP_WAIT_POLICY")  # spinning ones never wait for a partner that shares a core
    assert [threads.LoadFollower().wanted(n) for n in (0, 1, 2, 3)] == [2, 1, 1, 1]


def test_a_count_given_wins_over_an_environment_set_after_torch_read_it(monkeypatch, counts):
    """Ray sets OMP_NUM_THREADS in a worker after torch has read it: `use_cores(1)` there must still
    run torch and numba on one thread; with no count given, the environment's is kept."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(2)
    assert threads.use_cores(1) == 1 and torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    assert threads.planned() == 1
    torch.set_num_threads(2)
    threads.use_cores()
    assert torch.get_num_threads() == 2


def test_a_new_stepping_thread_runs_the_planned_count_where_the_load_is_not_followed(monkeypatch, counts):
    """numba's count is each thread's own: a server's engine thread (a 1-CPU Ray replica's) that never
    set it ran every CPU, whatever `use_cores` said on the main thread."""
    for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "LARQLPY_FOLLOW_LOAD"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "_planned", 1)
    numba.set_num_threads(1)
    seen = {}

    def step():
        seen["before"] = numba.get_num_threads()
        follow = threads.LoadFollower()
        seen["follows"], seen["count"] = follow.on, follow()
        seen["after"] = numba.get_num_threads()

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert seen == {"before": numba.config.NUMBA_NUM_THREADS, "follows": False, "count": 1, "after": 1}


@pytest.mark.skipif(threads.os.cpu_count() != len(threads.os.sched_getaffinity(0)),
                    reason="CPUs outside this process's affinity may take the busy loop")
def test_a_busy_process_is_seen_as_taking_a_cpu():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert max(contention.running_outside() for _ in range(20)) >= 1
    finally:
        busy.kill()
        busy.wait()
    assert 1 <= contention.own_running() <= len(threads.os.listdir("/proc/self/task"))


def _logprobs(loaded, readings, monkeypatch):
    from larqlpy.api.model import Model

    _fake_load(monkeypatch, readings)
    toks = list(Model(loaded).generate("The lighthouse keeper found a bottle on the shore. " * 12, max_tokens=24,
                                       temperature=0.0, logprobs=5, stop_at_eos=False))
    return [(t.id, repr(t.logprob)) for t in toks]


@pytest.mark.skipif(len(threads.os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("weights", ["native", "int4"])
def test_switching_threads_mid_run_changes_no_number(weights, monkeypatch, counts):
    """A prefill and decode whose thread count flips 2 -> 1 -> 2 while they run give the same
    log-probabilities, bit for bit, as on 2 threads throughout and on 1 throughout."""
    from larqlpy.weights.loader import load

    loaded = load(smol_gguf(), device="cpu", weights=weights)
    monkeypatch.setattr(threads, "_planned", 2)
    steady = _logprobs(loaded, [0] * 100, monkeypatch)
    set_to, real_set = [], threads.LoadFollower.set
    monkeypatch.setattr(threads.LoadFollower, "set", lambda self, n: (set_to.append(n), real_set(self, n)))
    flipping = _logprobs(loaded, [1, 1, 0, 0, 0] * 20, monkeypatch)
    assert set_to.count(1) >= 5 and set_to.count(2) >= 5  # it did flip, between the steps
    monkeypatch.setattr(threads, "_planned", 1)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    one = _logprobs(loaded, [0] * 100, monkeypatch)
    assert steady == flipping == one
