"""The tokenizer's helper process (`larqlpy run` loads tokenizer.json there while torch imports): the
same ids and text as the tokenizer in-process, its refusals as one line, and no helper left behind
when the parent closes it or is killed. Each case runs in a fresh interpreter, as the CLI does:
`start` forks only before torch is imported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from larqlpy.config import GenerationConfig
from larqlpy.api.model import engine_spec
from larqlpy.decode.stream import stream_generate

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

SAME = r"""
import json, sys
from pathlib import Path
from larqlpy.text.tokenizer_process import start
model = Path(sys.argv[1])
helper = start(model)
assert helper is not None
import torch  # what the helper overlaps; once it is in, start() declines to fork
assert start(model) is None
from larqlpy.model.families import read_config
from larqlpy.text.tokenizer import Tokenizer
remote, local = helper.tokenizer(), Tokenizer.from_dir(model, read_config(model))
texts = ["Hello", "", "The capital of France is", "naïve café — 東京 🙂", "<start_of_turn>user\nhi<end_of_turn>",
         "  spaces\t\ttabs\n\nnewlines  "]
for t in texts:
    assert remote.encode(t) == local.encode(t), t
    assert remote.encode(t, add_bos=False) == local.encode(t, add_bos=False), t
    ids = local.encode(t)
    assert remote.decode(ids) == local.decode(ids), t
ids = local.encode(texts[3], add_bos=False)
a, b = remote.stream(), local.stream()
assert [a.step(i) for i in ids] == [b.step(i) for i in ids]
for name in ("bos_id", "add_bos", "stop_ids", "fingerprint", "config", "vocab_size"):
    assert getattr(remote, name) == getattr(local, name), name
assert remote.special_tokens() == local.special_tokens()
print(json.dumps({"pid": helper.process.pid}))
remote.close()
helper.process.join(10)
assert not helper.process.is_alive()
print("ok")
"""

KILLED = r"""
import sys, time
from larqlpy.text.tokenizer_process import start
helper = start(sys.argv[1])
helper.tokenizer()
print(helper.process.pid, flush=True)
time.sleep(600)
"""


def python(code: str, *args, **kw):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=300, **kw)


def test_helper_answers_as_the_tokenizer_in_process(real_dir):
    r = python(SAME, real_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "ok"


def test_helper_ends_with_a_killed_parent(real_dir):
    parent = subprocess.Popen([sys.executable, "-c", KILLED, str(real_dir)], stdout=subprocess.PIPE, text=True, env=ENV)
    pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    for _ in range(100):  # the helper reads EOF on its pipe and returns
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its (dead) parent's reaper has ended too
            if f.read().split(") ")[1].startswith("Z"):
                return
        time.sleep(0.1)
    raise AssertionError(f"helper {pid} still running after its parent was killed")


def test_run_streams_the_same_text_through_the_helper(real_dir, real):
    """The console script (helper) and the library (in-process tokenizer) give the same greedy text,
    streamed and as JSON."""
    prompt = "The capital of France is"
    got = [subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "run", str(real_dir), prompt, "-n", "12", *extra],
                          capture_output=True, text=True, env=ENV, timeout=300) for extra in ([], ["--json"])]
    assert all(r.returncode == 0 for r in got), [r.stderr for r in got]
    spec = engine_spec(None, None, None)
    ids = real.tokenizer.encode(prompt)
    text = "".join(t.text for t in stream_generate(real.model, ids, spec, GenerationConfig(max_tokens=12),
                                                   stop_ids=real.tokenizer.stop_ids, tokenizer=real.tokenizer))
    assert got[0].stdout == text + "\n"
    assert json.loads(got[1].stdout)["text"] == text


def test_the_console_script_leaves_no_helper_behind(real_dir):
    """`larqlpy run` exits without the interpreter's teardown (cli/main.entry), after the exit
    handlers: the helper is gone with it, and the exit code and output are whole."""
    marker = f"marker {uuid.uuid4().hex}"
    r = subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "run", str(real_dir), marker, "-n", "2", "--json"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["finish_reason"] == "length"

    def holders():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    for _ in range(50):
        if not holders():
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still hold the run's arguments: {holders()}")
