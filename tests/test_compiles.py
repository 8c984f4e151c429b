"""Kernel compiles: the watcher's totals (kernels/compiles.py), the CLI's progress line
(cli/compiling.py), and compile time kept out of prefill and decode (Sequence's Metrics). Each test
compiles a kernel defined afresh (cache=False), so it compiles whatever numba's cache holds."""

from __future__ import annotations

import io
from pathlib import Path
import json

import pytest
from numba import njit
from rich.console import Console

from larqlpy.cli.compiling import CompileProgress, compile_progress
from larqlpy.config import GenerationConfig
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import generate_step
from larqlpy.kernels import compiles
from larqlpy.kernels.compiles import Progress
from larqlpy.weights.loader import load
from conftest import smol_gguf
from tiny import make_tiny


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    """The progress lines these tests test (conftest keeps them off for other tests' commands)."""
    monkeypatch.setenv("LARQLPY_COMPILE_PROGRESS", "1")


def fresh_kernel():
    """A kernel numba has never compiled, calling another one: one outermost compile."""
    @njit(cache=False)
    def inner(x):
        return x * 2.0 + 1.0

    @njit(cache=False)
    def outer(x):
        s = 0.0
        for i in range(x.shape[0]):
            s += inner(x[i])
        return s

    return outer


def heard():
    seen: list[Progress] = []
    return seen, compiles.on_progress(seen.append)


def test_watcher_counts_the_outermost_compile_once():
    import numpy as np

    kernel = fresh_kernel()
    seen, listening = heard()
    before_s, before_n = compiles.seconds(), compiles.count()
    with listening:
        kernel(np.ones(3))
        kernel(np.ones(4))  # compiled already: no event
    assert [p.seconds is None for p in seen] == [True, False]
    assert seen[0].kernel == seen[1].kernel == "test_compiles outer"
    assert compiles.count() == before_n + 1
    assert compiles.seconds() - before_s == pytest.approx(seen[1].seconds)


def test_once_counts_a_measured_choice_beside_the_compiles_inside_it():
    import numpy as np

    kernel = fresh_kernel()
    seen, listening = heard()
    before = compiles.seconds()
    with listening, compiles.once("choice a shape"):
        kernel(np.ones(2))
    assert [(p.kernel, p.seconds is None) for p in seen] == \
        [("test_compiles outer", True), ("test_compiles outer", False), ("choice a shape", False)]
    assert compiles.seconds() - before == pytest.approx(seen[1].seconds + seen[2].seconds)


def test_plain_progress_lines_say_what_compiles_and_that_it_happens_once():
    import numpy as np

    kernel = fresh_kernel()
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with compile_progress(console, live=False):
        kernel(np.ones(2))
        kernel(np.ones(2))
    lines = buf.getvalue().splitlines()
    assert lines[0] == "larqlpy: compiling kernels for this CPU (once: later runs load them from numba's cache)"
    assert lines[1].startswith("larqlpy: compiled 1: test_compiles outer (")
    assert lines[2].startswith("larqlpy: compiled 1 kernel for this CPU in ") and len(lines) == 3
    buf.truncate(0)
    buf.seek(0)
    with compile_progress(console, live=False):  # warm: nothing compiles, nothing is said
        kernel(np.ones(2))
    assert buf.getvalue() == ""


def test_live_status_stops_before_the_answer_on_the_same_terminal():
    buf = io.StringIO()
    printer = CompileProgress(Console(file=buf, force_terminal=True, width=200), live=True, shares_screen=True)
    printer(Progress("qdot int4 vnni512", None, 0, 0.0))
    assert printer.status is not None
    printer(Progress("qdot int4 vnni512", 2.0, 1, 2.0))
    printer.pause()
    assert printer.status is None and "compiled 1 kernel for this CPU in 2.0 s so far" in buf.getvalue()
    printer(Progress("decode attend chunk", None, 1, 2.0))  # mid-answer: no status drawn over it
    printer(Progress("decode attend chunk", 3.0, 2, 5.0))
    assert printer.status is None
    printer.done()
    assert "compiled 2 kernels for this CPU in 5.0 s (once" in buf.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d)
    return load(d)


def test_a_compile_inside_decode_is_compile_time_not_decode_time(tiny, monkeypatch):
    import numpy as np

    model, kernel, calls = tiny.model, fresh_kernel(), []
    forward = model.forward_many

    def forward_compiling(*args, **kw):
        calls.append(1)
        if len(calls) == 3:  # the second decode step
            kernel(np.ones(2))
        return forward(*args, **kw)

    monkeypatch.setattr(model, "forward_many", forward_compiling)
    seq = Sequence(model, [2, 7, 9, 11], gen=GenerationConfig(max_tokens=5, stop_at_eos=False))
    seen, listening = heard()
    with listening:
        toks = list(generate_step(model, seq))
    forced = next(p.seconds for p in seen if p.kernel == "test_compiles outer" and p.seconds is not None)
    m = toks[-1].metrics
    assert m.compile_seconds >= forced
    assert m.decode_seconds <= (seq.t_end - seq.t_decode) - forced + 1e-9
    assert m.decode_seconds > 0 and m.as_dict()["compile_seconds"] == round(m.compile_seconds, 6)


def test_run_json_reports_compile_seconds(cli, tiny, tmp_path):
    d = tmp_path / "t"
    make_tiny(d)
    rc, out, err = cli("run", d, "hello", "-n", "3", "--json")
    assert rc == 0, err
    assert "compile_seconds" in json.loads(out)["stats"]


def test_warmup_refuses_what_is_not_a_model(cli, tmp_path):
    for bad in (tmp_path / "missing.gguf", tmp_path):
        rc, out, err = cli("warmup", bad)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("larqlpy: error:"), err


@pytest.mark.heavy
def test_a_second_warmup_has_nothing_to_compile(cli, tmp_path):
    d = tmp_path / "t"
    make_tiny(d)
    rc, out, err = cli("warmup", d)
    assert rc == 0, err
    assert "int4 codec/v1" in out and "2 sequences batched" in out
    rc, out, err = cli("warmup", d)
    assert rc == 0 and out.splitlines()[-1].startswith("nothing needed compiling"), out


@pytest.mark.heavy
def test_a_cold_cache_run_says_it_compiles_and_a_warm_one_does_not(tmp_path):
    """A real `larqlpy run` on a fresh numba cache: the progress lines on stderr, the answer on stdout
    as a warm run gives it; the next run measures only the prefetch distance (not measured while the
    helper compiled: kernels/ahead.py), and the one after says nothing of compiling."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "LARQLPY_COMPILE_PROGRESS": "1"}  # conftest keeps it off for the other tests' commands
    cmd = [sys.executable, "-m", "larqlpy.cli.main", "run", str(smol_gguf()), "The capital of France is", "-n", "6",
           "--stats"]
    cold, next_, warm = (subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600) for _ in range(3))
    assert cold.returncode == next_.returncode == warm.returncode == 0, cold.stderr
    assert [line for line in next_.stderr.splitlines() if "compiled 1: " in line] == \
        [line for line in next_.stderr.splitlines() if "compiled 1: measured codes prefetched ahead" in line]
    assert cold.stderr.startswith("larqlpy: compiling kernels for this CPU (once"), cold.stderr
    assert "larqlpy: compiled 1: " in cold.stderr and "| compile " in cold.stderr
    assert cold.stdout == warm.stdout and cold.stdout.strip()
    assert "compil" not in warm.stderr and "| compile " not in warm.stderr


def test_a_cold_cache_is_seen_from_the_files_alone(tmp_path, monkeypatch):
    """`looks_cold`: no compiled decode attention where numba caches it (a user-provided directory
    here) is cold; one data file of it there is warm -- and plain lines say so before any compile."""
    from numba.core import config
    from numba.core.caching import UserProvidedCacheLocator

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    assert compiles.looks_cold()
    buf = io.StringIO()
    with compile_progress(Console(file=buf, force_terminal=False, width=200), live=False):
        assert buf.getvalue().startswith("larqlpy: compiling kernels for this CPU (once")
    source = str(Path(compiles.__file__).parent / "attention" / "decode.py")
    where = Path(UserProvidedCacheLocator(compiles.looks_cold, source).get_cache_path())
    where.mkdir(parents=True)
    (where / "decode._attend_chunk_64-150.py311.nbi").touch()  # an index alone: tie writes it empty
    assert compiles.looks_cold()
    (where / "decode._attend_chunk_64-150.py311.1.nbc").touch()
    assert not compiles.looks_cold()
