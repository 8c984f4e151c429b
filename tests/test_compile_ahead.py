"""The helper process that compiles a cold run's kernels ahead (kernels/ahead.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from larqlpy.kernels import ahead, compiles

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "models" / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"

# In a fresh process: the planned jobs first, then a real load and two tokens; each kernel's first
# call with a new signature (numba's `_compile_for_args`: compiled, or loaded from the cache) is
# recorded, so whatever the run needs beyond the jobs' signatures shows up as the run's own.
RECORD = """
import json, sys
from numba.core import dispatcher
import larqlpy
from larqlpy.kernels import ahead
calls, phase = [], ["jobs"]
original = dispatcher._DispatcherBase._compile_for_args
def record(self, *args, **kw):
    calls.append((phase[0], self.py_func.__module__ + "." + self.py_func.__name__))
    return original(self, *args, **kw)
dispatcher._DispatcherBase._compile_for_args = record
names = json.loads(sys.argv[2])
for name in names:
    ahead.jobs()[name]()
phase[0] = "run"
m = larqlpy.load(sys.argv[1])
list(m.generate("Write a haiku about rust.", max_tokens=2))
print(json.dumps(calls))
"""


def test_plan_takes_the_last_kernels_first():
    types = ["Q8_0", "Q5_0", "Q8_0", "Q6_K", "Q4_K", "F32"]
    assert ahead.plan(types) == ["attend 64", "norms", "qkv", "product Q4_K", "product Q6_K", "product Q5_0",
                                 "product Q8_0"]
    assert ahead.plan(["Q4_K", "Q6_K"], head=128) == ["attend 128", "norms", "qkv", "product Q6_K", "product Q4_K"]
    assert ahead.plan(["Q4_K"], head=80)[0] == "attend other"
    assert ahead.plan(["F32", "BF16"]) == []


def test_every_job_name_is_a_job():
    for head in (64, 128, 256, 80):
        names = ahead.plan(list(ahead.LAYOUTS), head)
        assert set(names) <= set(ahead.jobs())


@pytest.mark.heavy  # a helper process compiling: the suite's 30-minute budget
def test_the_jobs_compile_the_signatures_the_run_calls():
    """Every kernel a job compiles is one the run calls, with the same signature: the run calls none
    of them again with another (it would compile it anew: the helper's work wasted)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), ahead.ENV: "0"}
    names = ahead.plan(["Q8_0", "Q5_0", "Q6_K", "Q4_K"])
    done = subprocess.run([sys.executable, "-c", RECORD, str(GGUF), json.dumps(names)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    by_jobs = {k for phase, k in calls if phase == "jobs"}
    by_run = {k for phase, k in calls if phase == "run"}
    assert {"larqlpy.kernels.attention.decode._attend_chunk_64", "larqlpy.kernels.weights.matvec._qkv_rope"} <= by_jobs
    assert not any("gguf_blocks._rows" in k for k in by_jobs | by_run)  # the embedding's rows: numpy (BlockRows)
    assert sum(".qdot._int" in k for k in by_jobs) == 4  # the file's four code widths, on this CPU's path
    assert not by_jobs & by_run, f"the run compiled again: {sorted(by_jobs & by_run)}"


def test_a_helper_started_is_said_at_once(monkeypatch):
    """A cold cache: the progress line comes as the helper starts, before this process compiles."""
    import io

    from rich.console import Console

    from larqlpy.cli.compiling import compile_progress

    monkeypatch.setenv("LARQLPY_COMPILE_PROGRESS", "1")
    monkeypatch.delenv(ahead.ENV, raising=False)
    monkeypatch.setattr(compiles, "looks_cold", lambda: False)  # none begun early: this one starts its own
    started = []
    monkeypatch.setattr(ahead, "cold", lambda: True)
    monkeypatch.setattr(ahead.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or _Done())
    buf = io.StringIO()
    with compile_progress(Console(file=buf, force_terminal=False, width=200), live=False):
        assert ahead.start(["attend 64", "norms"]) is not None
    assert started and started[0][-2:] == ["attend 64", "norms"]
    assert buf.getvalue().splitlines()[0] == \
        "larqlpy: compiling kernels for this CPU (once: later runs load them from numba's cache)"
    monkeypatch.setenv(ahead.ENV, "0")
    assert ahead.start(["attend 64"]) is None


class _Done:
    """A helper process that has ended."""

    stdin = None

    def poll(self):
        return 0


class _Pipe:
    """A helper's stdin, kept as written."""

    def __init__(self):
        self.data, self.closed = b"", False

    def write(self, b: bytes) -> None:
        self.data += b

    def close(self) -> None:
        self.closed = True


class _Waiting(_Done):
    """A helper process still at work, its stdin a _Pipe."""

    def __init__(self, cmd):
        self.cmd, self.stdin = cmd, _Pipe()

    def poll(self):
        return None


def test_a_helper_begun_early_is_told_the_models_jobs_and_a_run_that_has_none_lets_it_end(monkeypatch):
    """compiles.begin_ahead starts the helper on the jobs every CPU run needs before the model is read;
    ahead.start hands it the model's jobs on its stdin, ended by a blank line (a forked child may
    hold the pipe open, so no end of file comes), and starts no second process."""
    started = []
    monkeypatch.delenv(ahead.ENV, raising=False)
    monkeypatch.setattr(compiles, "looks_cold", lambda: True)
    monkeypatch.setattr(ahead, "cold", lambda: True)
    monkeypatch.setattr(compiles.subprocess, "Popen", lambda cmd, **kw: started.append(_Waiting(cmd)) or started[-1])
    monkeypatch.setattr(compiles, "_early", [])
    monkeypatch.setattr(compiles.atexit, "register", lambda *a: None)
    monkeypatch.setattr(ahead, "_helpers", [])
    compiles.begin_ahead()
    compiles.begin_ahead()  # once
    assert len(started) == 1 and started[0].cmd[-3:] == ["--more", *compiles.EARLY]
    assert ahead.start(["attend 64", "norms", "product Q4_K"]) is started[0] and len(started) == 1
    assert started[0].stdin.data == b"attend 64\nnorms\nproduct Q4_K\n\n" and started[0].stdin.closed
    assert compiles.early_helper() is None and ahead.busy()
    monkeypatch.setattr(compiles, "_early", [])
    compiles.begin_ahead()
    assert ahead.start([]) is None  # told nothing: it ends after its early jobs
    assert started[-1].stdin.closed and started[-1].stdin.data == b""


def test_a_load_with_no_jobs_for_the_helper_lets_an_early_one_end(monkeypatch, smol_dir):
    """A float directory (no file's own codes): the load tells a helper begun early it has nothing,
    so it does not wait out the process (a server's life) for its jobs."""
    import larqlpy

    early = _Waiting(["--more", *compiles.EARLY])
    monkeypatch.setattr(compiles, "_early", [early])
    monkeypatch.setattr(ahead, "_helpers", [])
    larqlpy.load(smol_dir, device="cpu")
    assert early.stdin.closed and early.stdin.data == b"" and not ahead.started()


def test_the_helper_reads_its_later_jobs_to_a_blank_line(tmp_path):
    """The helper's own side: the early jobs, then the lines up to a blank one, while its stdin stays
    open (a job already done is not run twice)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), ahead.ENV: "0", "NUMBA_CACHE_DIR": str(tmp_path)}
    helper = subprocess.Popen([sys.executable, "-m", "larqlpy.kernels.ahead", "--more", "norms"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        helper.stdin.write("norms\nqkv\n\n")
        helper.stdin.flush()  # not closed
        lines = [helper.stdout.readline().split(":")[0] for _ in range(2)]
        assert lines == ["norms", "qkv"]
        assert helper.wait(timeout=120) == 0
    finally:
        helper.kill()
