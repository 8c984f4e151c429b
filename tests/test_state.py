"""Persistent attention state: save, resume in another process, prompt cache, trims, and refusals."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from larqlpy.cli.common import error_line
from larqlpy.engines import EngineSpec, parse_engine_spec, preset_spec
from larqlpy.engines.presets import SPREAD
from larqlpy.errors import LarqlError
from larqlpy.config import GenerationConfig
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import generate_step, stream_generate
from larqlpy.weights.loader import load
from larqlpy.state.saved import FileSource, save
from larqlpy.state.format import PREFIX, load_state
from tiny import make_tiny, write_in_place

WORKERS = str(Path(__file__).with_name("workers.py"))
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
PROMPT = [2] + [7 + (i * 37) % 280 for i in range(40)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


def run(loaded, spec, ids, n):
    """n tokens after ids; (the tokens, the state it leaves with the tokens it holds)."""
    seq = Sequence(loaded.model, ids, spec, GenerationConfig(max_tokens=n, stop_at_eos=False))
    toks = list(generate_step(loaded.model, seq))
    return toks, seq.held()


def resume(loaded, path, ids, spec, reprefill=False):
    """A state file as a request's first state, as `resume` reads it: (what it gives, the engine, the ids)."""
    source = FileSource(loaded, path, reprefill)
    spec = source.spec(spec)
    ids = source.tokens if ids is None else ids
    return source.take(ids, spec), spec, ids


def resume_elsewhere(model_dir, path, n, tmp_path, weights="f32", kv_dtype=""):
    out = tmp_path / "resumed.pt"
    subprocess.run([sys.executable, WORKERS, "resume", str(model_dir), str(path), str(n), str(out), weights, kv_dtype],
                   check=True, env=ENV, timeout=300)
    return torch.load(out)


@pytest.mark.parametrize("preset", SPREAD, ids=lambda p: p[0] + "".join(f",{k}={v}" for k, v in p[1]))
def test_resume_in_a_new_process_is_bit_identical(tiny, tiny_dir, tmp_path, preset):
    spec = preset_spec(preset)
    whole, _ = run(tiny, spec, PROMPT, 20)
    first, held = run(tiny, spec, PROMPT, 8)
    path = tmp_path / "s.kv"
    assert held.tokens == PROMPT + [t.id for t in first]
    save(tiny, path, held)
    got = resume_elsewhere(tiny_dir, path, 12, tmp_path)
    assert [t.id for t in whole[8:]] == got["ids"]
    assert torch.equal(torch.stack([t.logits for t in whole[8:]]), got["logits"])


# window/v1's resume is held on the tiny model under every preset above; the 270M's runs in make test
@pytest.mark.parametrize("identity, options", [pytest.param("window/v1", [], marks=pytest.mark.heavy),
                                               ("codec/v1", ["bits=4"])])
def test_resume_on_the_270m(real, real_dir, tmp_path, long_text, identity, options):
    spec = parse_engine_spec(continuation=identity, options=options)
    ids = real.tokenizer.encode(long_text)[:600]  # past the window
    whole, _ = run(real, spec, ids, 12)
    first, held = run(real, spec, ids, 4)
    assert held.tokens == ids + [t.id for t in first]
    save(real, tmp_path / "s.kv", held)
    got = resume_elsewhere(real_dir, tmp_path / "s.kv", 8, tmp_path)
    assert [t.id for t in whole[4:]] == got["ids"]
    assert torch.equal(torch.stack([t.logits for t in whole[4:]]), got["logits"])


def test_extending_prompt_prefills_only_the_suffix(tiny, tmp_path):
    spec = EngineSpec()
    _, held = run(tiny, spec, PROMPT, 1)
    save(tiny, tmp_path / "s.kv", held)
    longer = PROMPT + [50, 60, 70, 80, 90]
    got, spec, ids = resume(tiny, tmp_path / "s.kv", longer, None)
    assert got.info["reused_tokens"] == len(PROMPT) and got.info["trimmed_from"] is None
    toks = list(stream_generate(tiny.model, ids, spec, GenerationConfig(max_tokens=3), held=got.held))
    assert toks[0].metrics.prefilled_tokens == 5 and toks[0].metrics.prompt_tokens == len(longer)
    fresh, _ = run(tiny, spec, longer, 3)
    assert [t.id for t in toks] == [t.id for t in fresh]
    assert max((a.logits - b.logits).abs().max().item() for a, b in zip(toks, fresh)) < 1e-4


def test_diverging_prompt_trims_where_it_can(tiny, tmp_path):
    _, held = run(tiny, EngineSpec(), PROMPT, 1)
    save(tiny, tmp_path / "c.kv", held)
    other = PROMPT[:30] + [99, 98, 97]
    got, spec, ids = resume(tiny, tmp_path / "c.kv", other, None)
    assert got.info["reused_tokens"] == 30 and got.info["trimmed_from"] == len(PROMPT)
    toks = list(stream_generate(tiny.model, ids, spec, GenerationConfig(max_tokens=4), held=got.held))
    fresh, _ = run(tiny, EngineSpec(), other, 4)
    assert [t.id for t in toks] == [t.id for t in fresh]
    # window/v1 with a 16-row window cannot go back 10 positions: refused, unless asked to re-prefill
    spec = parse_engine_spec(continuation="window/v1")
    _, wheld = run(tiny, spec, PROMPT, 1)
    save(tiny, tmp_path / "w.kv", wheld)
    with pytest.raises(LarqlError) as e:
        resume(tiny, tmp_path / "w.kv", other, None)
    assert "pass --reprefill" in error_line(e.value) and "pass `reprefill`" in str(e.value)
    got, _, _ = resume(tiny, tmp_path / "w.kv", other, None, reprefill=True)
    assert got.info["reused_tokens"] == 0 and got.held is None  # a fresh state
    # one position back is always possible (the window keeps one row more than a query reads)
    got, _, _ = resume(tiny, tmp_path / "w.kv", PROMPT[:-1] + [5], None)
    assert got.info["reused_tokens"] == len(PROMPT) - 1


def test_cli_save_resume_and_inspect(tiny_dir, tmp_path):
    exe = [sys.executable, "-m", "larqlpy.cli.main"]
    s = str(tmp_path / "s.kv")
    a = subprocess.run([*exe, "run", str(tiny_dir), "the cat", "-n", "6", "--json", "--save-state", s],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert a.returncode == 0, a.stderr
    b = subprocess.run([*exe, "run", str(tiny_dir), "", "--resume", s, "-n", "6", "--json"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    whole = subprocess.run([*exe, "run", str(tiny_dir), "the cat", "-n", "12", "--json"],
                           capture_output=True, text=True, env=ENV, timeout=300)
    assert json.loads(a.stdout)["tokens"] + json.loads(b.stdout)["tokens"] == json.loads(whole.stdout)["tokens"]
    first = json.loads(a.stdout)
    assert json.loads(b.stdout)["session"]["reused_tokens"] == first["prompt_tokens"] + len(first["tokens"]) - 1
    info = subprocess.run([*exe, "state", "inspect", s, "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    d = json.loads(info.stdout)
    assert d["engine"] == {"identity": "canonical/v1", "options": {}} and d["processed"] == d["tokens"] - 1
    assert all(layer["cells"] for layer in d["layers"])
    bad = subprocess.run([*exe, "run", str(tiny_dir), "", "--resume", s, "--continuation", "window/v1"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "made with engine canonical/v1" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.fixture
def saved(tiny, tmp_path):
    spec = parse_engine_spec(continuation="codec/v1", options=["bits=4"])
    _, held = run(tiny, spec, PROMPT, 3)
    path = tmp_path / "s.kv"
    save(tiny, path, held)
    return path, spec


def test_load_refusals(tiny, tmp_path, saved, tiny_dir):
    path, spec = saved
    raw = path.read_bytes()
    header_len = struct.unpack_from("<Q", raw, 16)[0]

    def write(data):
        p = tmp_path / f"x{random.random()}.kv"
        p.write_bytes(data)
        return p

    cases = [
        (b"NOTLARQL" + raw[8:], "bad magic"),
        (raw[:8] + struct.pack("<I", 9) + raw[12:], "format version 9 is not supported"),
        (raw[:20], "too short"),
        (raw[:PREFIX.size + header_len // 2], "truncated: header"),
        (raw[:len(raw) - 100], "truncated: data"),
        (raw[:PREFIX.size + 5] + bytes([raw[PREFIX.size + 5] ^ 1]) + raw[PREFIX.size + 6:], "header checksum mismatch"),
        (raw[:-50] + bytes([raw[-50] ^ 0xFF]) + raw[-49:], "checksum mismatch in"),
    ]
    for data, needle in cases:
        with pytest.raises(LarqlError, match=needle):
            load_state(write(data))
    # a flipped byte in the first cell's data names that cell
    h = load_state(path).header
    first = h["cells"][0]
    off = ((PREFIX.size + header_len + 4095) // 4096) * 4096 + first["fields"]["k_code"]["offset"]
    with pytest.raises(LarqlError, match=f"cell layer {first['layer']} positions {first['start']}-"):
        load_state(write(raw[:off] + bytes([raw[off] ^ 0x10]) + raw[off + 1:]))
    # engine, options, model, tokenizer
    with pytest.raises(LarqlError, match="made with engine codec/v1"):
        resume(tiny, path, None, parse_engine_spec(continuation="codec/v1", options=["bits=3"]))
    # the defaults as they applied: no calibration on the tiny model, so calib=auto was off
    with pytest.raises(LarqlError, match="made with engine codec/v1 \\[bits=4,calib=off,recent=16,sink=1\\], this run "
                                         "asks for window/v1"):
        resume(tiny, path, None, parse_engine_spec(continuation="window/v1"))
    other = tmp_path / "other"
    make_tiny(other, seed=9, sliding_window=16)
    with pytest.raises(LarqlError, match="made with a different model"):
        resume(load(other), path, None, None)
    retok = tmp_path / "retok"
    shutil.copytree(tiny_dir, retok)
    (retok / "tokenizer.json").write_text((retok / "tokenizer.json").read_text() + "\n")
    with pytest.raises(LarqlError, match="made with a different tokenizer"):
        resume(load(retok), path, None, None)


def test_a_state_of_other_weight_bytes_is_refused(tmp_path, monkeypatch):
    """The fingerprint samples each end of a weight file: a state made before an edit between them
    is refused all the same (the header holds the digest of the weight files' bytes); one written
    before states held it still resumes, on the sample alone."""
    import dataclasses

    import numpy as np

    from larqlpy.weights import checkpoint as files

    monkeypatch.setattr(files, "SAMPLE", 64)  # the tiny file's ends: like 1 MB of a 1 GB file's
    d = tmp_path / "m"
    make_tiny(d, sliding_window=16)
    loaded = load(d)
    _, held = run(loaded, EngineSpec(), PROMPT, 3)
    path, older = tmp_path / "s.kv", tmp_path / "older.kv"
    save(loaded, path, held)
    save(dataclasses.replace(loaded, weights_digest=None), older, held)
    assert "weights_digest" in load_state(path).header and "weights_digest" not in load_state(older).header
    resume(loaded, path, None, None)
    write_in_place(d / "model.safetensors", "model.layers.1.mlp.up_proj.weight", np.full(8, 0.75))
    edited = load(d)
    assert edited.fingerprint == loaded.fingerprint and edited.weights_digest != loaded.weights_digest
    with pytest.raises(LarqlError, match="made with other weights") as e:
        resume(edited, path, None, None)
    assert "--resume" in error_line(e.value)
    resume(edited, older, None, None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reader_never_fails_uncleanly(tmp_path, saved, data):
    """Random files and random damage to a real one: the reader loads it or refuses in one line."""
    path, _ = saved
    raw = bytearray(path.read_bytes())
    kind = data.draw(st.sampled_from(["random", "flip", "truncate", "splice"]))
    if kind == "random":
        blob = data.draw(st.binary(max_size=4096))
        if data.draw(st.booleans()):
            blob = raw[:8] + blob
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
        blob = bytes(raw)
    elif kind == "truncate":
        blob = bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    else:
        i = data.draw(st.integers(0, len(raw)))
        blob = bytes(raw[:i]) + data.draw(st.binary(min_size=1, max_size=64)) + bytes(raw[i:])
    p = tmp_path / "h.kv"
    p.write_bytes(blob)
    try:
        s = load_state(p)
    except LarqlError as e:
        assert "\n" not in str(e)
    else:
        assert s.header["tokens"]  # only damage in padding can leave it loadable


def test_kill_9_while_saving_leaves_a_loadable_state(tiny_dir, tmp_path):
    path = tmp_path / "s.kv"
    rng = random.Random(5)
    sizes = []
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, WORKERS, "save-forever", str(tiny_dir), str(path)],
                                stdout=subprocess.PIPE, text=True, env=ENV)
        proc.stdout.readline()  # at least one complete save
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        s = load_state(path)  # never half-written
        sizes.append(len(s.tokens))
        assert s.processed == len(s.tokens)
    assert max(sizes) > 8  # it was killed mid-stream, not only after the first save
    # the killed writers' temp files are left behind; the next save removes them, and its own
    proc = subprocess.Popen([sys.executable, WORKERS, "save-forever", str(tiny_dir), str(path)],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    proc.stdout.readline()
    proc.stdout.readline()  # a second save: it found the leftovers of the ones killed before
    proc.send_signal(signal.SIGSTOP)  # paused between saves or inside one: its own temp file is live
    live = [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
    assert len(live) <= 1 and all(f.name.startswith(f".s.kv.{proc.pid}.") for f in live)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    load_state(path)


def test_two_processes_resuming_one_file(tiny_dir, tmp_path):
    exe = [sys.executable, "-m", "larqlpy.cli.main"]
    s = str(tmp_path / "s.kv")
    subprocess.run([*exe, "run", str(tiny_dir), "the cat", "-n", "4", "--save-state", s], check=True, env=ENV,
                   capture_output=True, timeout=300)
    base = len(load_state(s).tokens)
    procs = [subprocess.Popen([*exe, "run", str(tiny_dir), "", "--resume", s, "-n", str(n), "--save-state", s],
                              env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for n in (3, 9)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    final = load_state(s)
    # both resumed the first state (the last save wins), or one started after the other had saved
    # and resumed that (3 + 9 more): whole states either way, never a mix
    assert len(final.tokens) in (base + 3, base + 9, base + 12)
    leftovers = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert leftovers == []
