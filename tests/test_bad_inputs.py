"""Bad input, as a new user types it, through the real CLI in subprocesses: every case exits 2 (a
batch with a bad line: 1, the other lines run) with exactly one line on stderr and no traceback; a
state that existed before still loads afterwards; nothing was written where it should not be."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from larqlpy.state.format import load_state
from conftest import smol_gguf, without_compiles
from tiny import make_tiny

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]
BAD_UTF8 = b"the cat \xff\xfe sat"


def cli(*args, stdin: bytes | None = None, timeout: int = 300):
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([*EXE, *argv], input=stdin, capture_output=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model (context 512), broken copies of it, a saved state and a few input files."""
    root = tmp_path_factory.mktemp("bad")
    tiny = root / "tiny"
    make_tiny(tiny, sliding_window=16)
    w = {"root": root, "tiny": tiny}
    for name in ("nan", "nojson", "llama", "notensor", "trunc", "noconfig", "notok", "badtok"):
        shutil.copytree(tiny, root / name)
        w[name] = root / name
    weights = load_file(str(w["nan"] / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(weights, str(w["nan"] / "model.safetensors"))
    (w["nojson"] / "config.json").write_text("{ not json")
    cfg = json.loads((tiny / "config.json").read_text())
    (w["llama"] / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    del weights["model.layers.2.mlp.down_proj.weight"]
    save_file(weights, str(w["notensor"] / "model.safetensors"))
    f = w["trunc"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    (w["noconfig"] / "config.json").unlink()
    (w["notok"] / "tokenizer.json").unlink()  # `run` reads the tokenizer in its helper process
    (w["badtok"] / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    w["state"] = root / "s.kv"
    r = cli("run", tiny, "the cat", "-n", "3", "--save-state", w["state"])
    assert r.returncode == 0, r.stderr
    w["bad_state"] = root / "bad.kv"
    data = bytearray(w["state"].read_bytes())
    data[-100] ^= 0xFF
    w["bad_state"].write_bytes(bytes(data))
    w["short_state"] = root / "short.kv"
    w["short_state"].write_bytes(w["state"].read_bytes()[:5000])
    w["gguf_junk"] = root / "junk.gguf"
    w["gguf_junk"].write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)
    w["gguf_short"] = root / "short.gguf"  # a real GGUF's header, its tensors cut off
    with open(smol_gguf(), "rb") as f:
        w["gguf_short"].write_bytes(f.read(1 << 20))
    w["utf8_file"] = root / "latin1.txt"
    w["utf8_file"].write_bytes(BAD_UTF8 * 20)
    w["lines"] = root / "in.jsonl"
    w["lines"].write_text('{"prompt": "the cat", "max_tokens": 2}\n')
    return w


def p(w, key, *rest):
    return str(Path(w[key], *rest))


# (name, argv built from the world, stdin, needle in the one stderr line)
CASES = [
    # model directories and files
    ("missing model dir", lambda w: ["run", p(w, "root", "nope"), "hi"], None, "no such model directory"),
    ("a file as model dir", lambda w: ["run", p(w, "lines"), "hi"], None, "is a file, not a model directory"),
    ("no config.json", lambda w: ["run", p(w, "noconfig"), "hi"], None, "no config.json"),
    ("config.json not JSON", lambda w: ["run", p(w, "nojson"), "hi"], None, "not valid JSON"),
    ("no tokenizer.json", lambda w: ["run", p(w, "notok"), "hi"], None, "no tokenizer.json"),
    ("tokenizer.json unreadable", lambda w: ["run", p(w, "badtok"), "hi"], None, "not a readable tokenizer"),
    ("unknown model_type", lambda w: ["run", p(w, "llama"), "hi"], None, "unsupported model_type 'falcon'"),
    ("missing tensor", lambda w: ["run", p(w, "notensor"), "hi"], None, "missing tensor model.layers.2.mlp.down_proj"),
    ("truncated safetensors", lambda w: ["run", p(w, "trunc"), "hi"], None, "model.safetensors"),
    ("NaN in a weight", lambda w: ["run", p(w, "nan"), "hi"], None,
     "tensor model.layers.1.mlp.up_proj.weight holds 1 non-finite"),
    ("NaN in a weight, int8", lambda w: ["run", p(w, "nan"), "hi", "--weights", "int8"], None,
     "model.layers.1.mlp.up_proj.weight holds 1 non-finite"),
    ("info of a missing dir", lambda w: ["info", p(w, "root", "nope")], None, "no such model directory"),
    ("GGUF without a model", lambda w: ["convert-gguf", p(w, "gguf_junk"), p(w, "root", "out1")], None,
     "has no general.architecture"),
    ("GGUF not GGUF", lambda w: ["convert-gguf", p(w, "lines"), p(w, "root", "out2")], None, "not a readable GGUF"),
    ("run a GGUF without a model", lambda w: ["run", p(w, "gguf_junk"), "hi"], None, "has no general.architecture"),
    ("run a truncated GGUF", lambda w: ["run", p(w, "gguf_short"), "hi"], None, "truncated"),
    ("chat a truncated GGUF", lambda w: ["chat", p(w, "gguf_short")], b"hi\n", "truncated"),
    ("serve a GGUF without a model", lambda w: ["serve", p(w, "gguf_junk"), "--port", "18123"], None,
     "has no general.architecture"),
    ("batch a truncated GGUF", lambda w: ["batch", p(w, "gguf_short"), p(w, "lines"), "-o", p(w, "root", "o.jsonl")],
     None, "truncated"),
    ("info of a GGUF without a model", lambda w: ["info", p(w, "gguf_junk")], None, "has no general.architecture"),
    ("run a file that is not a GGUF", lambda w: ["run", p(w, "lines"), "hi"], None, "in.jsonl"),
    ("GGUF dest parent missing", lambda w: ["convert-gguf", p(w, "gguf_junk"), p(w, "root", "no", "out")], None,
     "does not exist"),
    # engine and sampling options
    ("unknown continuation", lambda w: ["run", p(w, "tiny"), "hi", "--continuation", "nope/v1"], None,
     "--continuation: unknown continuation identity"),
    ("unknown engine", lambda w: ["run", p(w, "tiny"), "hi", "--engine", "warp"], None, "--engine: unknown engine"),
    ("option without continuation", lambda w: ["run", p(w, "tiny"), "hi", "--continuation-option", "bits=4"], None,
     "--continuation-option needs --continuation"),
    ("codec width", lambda w: ["run", p(w, "tiny"), "hi", "--continuation", "codec/v1", "--continuation-option",
                               "bits=9"], None, "--continuation-option: codec/v1 option bits: must be one of 3, 4"),
    ("temperature nan", lambda w: ["run", p(w, "tiny"), "hi", "--temperature", "nan"], None,
     "--temperature must be a finite number"),
    ("top-p inf", lambda w: ["run", p(w, "tiny"), "hi", "--top-p", "inf"], None, "--top-p must be a finite number"),
    ("negative temperature", lambda w: ["run", p(w, "tiny"), "hi", "--temperature", "-1"], None,
     "--temperature must be >= 0"),
    ("kv budget words", lambda w: ["run", p(w, "tiny"), "hi", "--kv-budget", "lots"], None,
     "--kv-budget: expected a size like 64MiB"),
    ("kv budget and engine", lambda w: ["run", p(w, "tiny"), "hi", "--kv-budget", "1MiB", "--engine", "standard"],
     None, "--kv-budget applies to cells/v1"),
    ("weights format", lambda w: ["run", p(w, "tiny"), "hi", "--weights", "int3"], None, "--weights: expected one of"),
    ("device", lambda w: ["run", p(w, "tiny"), "hi", "--device", "tpu"], None, "--device: expected auto, cpu or cuda"),
    ("dtype", lambda w: ["run", p(w, "tiny"), "hi", "--dtype", "float16"], None, "--dtype: expected float32"),
    ("negative max tokens", lambda w: ["run", p(w, "tiny"), "hi", "-n", "-1"], None, "--max-tokens must be >= 0"),
    ("zero prefill chunk", lambda w: ["run", p(w, "tiny"), "hi", "--prefill-chunk", "0"], None,
     "--prefill-chunk must be >= 1"),
    ("reprefill alone", lambda w: ["run", p(w, "tiny"), "hi", "--reprefill"], None, "--reprefill only makes sense"),
    # serve: refused before the model loads
    ("serve kv budget", lambda w: ["serve", p(w, "tiny"), "--kv-budget", "lots"], None, "--kv-budget: expected a size"),
    ("serve port", lambda w: ["serve", p(w, "tiny"), "--port", "0"], None, "--port must be in 1..65535"),
    ("serve no-cache", lambda w: ["serve", p(w, "tiny"), "--engine", "no-cache"], None, "no-cache keeps no state"),
    ("serve state dir a file", lambda w: ["serve", p(w, "tiny"), "--state-dir", p(w, "tiny", "config.json")], None,
     "--state-dir"),
    ("batch parallel", lambda w: ["batch", p(w, "tiny"), "-", "--parallel", "0"], None, "--parallel must be >= 1"),
    # prompts
    ("prompt not UTF-8", lambda w: ["run", p(w, "tiny"), BAD_UTF8], None, "PROMPT: not valid UTF-8 (byte 0xff"),
    ("stdin not UTF-8", lambda w: ["run", p(w, "tiny"), "-"], BAD_UTF8, "stdin: not valid UTF-8 (byte 0xff"),
    ("prompt past the context", lambda w: ["run", p(w, "tiny"), "the cat " * 400], None,
     "the model's context is 512 positions"),
    # state files
    ("resume missing", lambda w: ["run", p(w, "tiny"), "hi", "--resume", p(w, "root", "none.kv")], None,
     "no such state file"),
    ("resume a directory", lambda w: ["run", p(w, "tiny"), "hi", "--resume", p(w, "root")], None,
     "is a directory, not a state file"),
    ("resume truncated", lambda w: ["run", p(w, "tiny"), "", "--resume", p(w, "short_state")], None, "truncated"),
    ("resume corrupted", lambda w: ["run", p(w, "tiny"), "", "--resume", p(w, "bad_state")], None,
     "checksum mismatch"),
    ("resume, other engine", lambda w: ["run", p(w, "tiny"), "", "--resume", p(w, "state"), "--continuation",
                                        "window/v1"], None, "made with engine canonical/v1"),
    ("resume, other dtype", lambda w: ["run", p(w, "tiny"), "", "--resume", p(w, "state"), "--dtype", "bfloat16"],
     None, "made with --dtype float32, this run loads the model with --dtype bfloat16"),
    ("resume, other weights", lambda w: ["run", p(w, "tiny"), "", "--resume", p(w, "state"), "--weights", "int8"],
     None, "made with --weights f32"),
    ("save into a missing dir", lambda w: ["run", p(w, "tiny"), "hi", "--save-state", p(w, "root", "no", "s.kv")],
     None, "--save-state"),
    ("save onto a directory", lambda w: ["run", p(w, "tiny"), "hi", "--save-state", p(w, "root")], None,
     "is a directory"),
    ("inspect junk", lambda w: ["state", "inspect", p(w, "lines")], None, "not a larqlpy state file"),
    ("inspect a directory", lambda w: ["state", "inspect", p(w, "root")], None, "is a directory, not a state file"),
    # batch files and output paths
    ("batch onto its input", lambda w: ["batch", p(w, "tiny"), p(w, "lines"), "-o", p(w, "lines")], None,
     "is also an input"),
    ("batch input missing", lambda w: ["batch", p(w, "tiny"), p(w, "root", "none.jsonl")], None, "none.jsonl"),
    ("batch input a directory", lambda w: ["batch", p(w, "tiny"), p(w, "root")], None, "is a directory"),
    ("batch output dir missing", lambda w: ["batch", p(w, "tiny"), p(w, "lines"), "-o", p(w, "root", "no", "o")],
     None, "does not exist"),
    ("monitor suffix", lambda w: ["run", p(w, "tiny"), "hi", "--monitor", p(w, "root", "m.txt")], None,
     "--monitor: expected a .csv or .json"),
    ("monitor dir missing", lambda w: ["run", p(w, "tiny"), "hi", "--monitor", p(w, "root", "no", "m.csv")], None,
     "--monitor"),
    ("rules-out dir missing", lambda w: ["kv-stats", p(w, "tiny"), "the cat", "--rules-out",
                                         p(w, "root", "no", "r.yaml")], None, "--rules-out"),
    ("kv-stats file not UTF-8", lambda w: ["kv-stats", p(w, "tiny"), p(w, "utf8_file")], None,
     "not valid UTF-8 (byte 0xff"),
    ("kv-stats past the context", lambda w: ["kv-stats", p(w, "tiny"), "the cat", "--max-positions", "99999"], None,
     "past the model's context of 512"),
    ("ladder plot suffix", lambda w: ["bench", "ladder", p(w, "tiny"), "--plot", p(w, "root", "x.txt")], None,
     "--plot: expected a .png"),
    ("residency past the context", lambda w: ["residency", "gemma3-270m", "--positions", "1000000"], None,
     "past gemma3-270m's context of 32,768"),
    ("residency budget words", lambda w: ["residency", "gemma3-270m", "--budget", "lots"], None,
     "--budget: expected a size"),
    ("calibrate text missing", lambda w: ["calibrate", p(w, "tiny"), "--text", p(w, "root", "none.txt")], None,
     "--text"),
]


@pytest.mark.parametrize("name, argv, stdin, needle", CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line(world, name, argv, stdin, needle):
    before = world["state"].read_bytes()
    r = cli(*argv(world), stdin=stdin)
    err = without_compiles(r.stderr.decode("utf-8", "replace"))  # a cold cache's progress lines are not the refusal
    lines = [line for line in err.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, err)
    assert len(lines) == 1 and lines[0].startswith("larqlpy: error:"), err
    assert "Traceback" not in err
    assert needle in lines[0], (needle, lines[0])
    assert r.stdout == b"" or name == "prompt past the context", r.stdout  # refused before any output
    assert world["state"].read_bytes() == before
    load_state(world["state"])  # the state that existed still loads


def test_there_are_enough_cases():
    assert len(CASES) >= 40


def test_a_bad_batch_line_is_an_error_record_and_the_others_run(world):
    src = world["root"] / "mixed.jsonl"
    src.write_bytes(b'{"prompt": "the cat", "max_tokens": 2}\n' + b'{"prompt": "' + BAD_UTF8 + b'"}\n'
                    + b'["a", "list"]\n{"prompt": "the dog", "max_tokens": 2, "temperature": NaN}\n'
                    + b'{"prompt": "in", "max_tokens": 2}\n')
    out = world["root"] / "mixed.out.jsonl"
    r = cli("batch", world["tiny"], src, "-o", out, "--quiet")
    assert r.returncode == 1 and r.stderr == b"", r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["line"] for x in recs] == [1, 2, 3, 4, 5]
    assert [x["error"] is None for x in recs] == [True, False, False, False, True]
    assert "not valid UTF-8 (byte 0xff" in recs[1]["error"]
    assert "expected a JSON object, got an array" in recs[2]["error"]
    assert "`temperature` must be a finite number" in recs[3]["error"]
    assert len(recs[0]["tokens"]) == len(recs[4]["tokens"]) == 2
    assert not [f for f in world["root"].iterdir() if f.name.startswith(".mixed.out")]  # no temp file left


def test_max_tokens_past_the_context_is_capped_and_said(world):
    r = cli("run", world["tiny"], "the cat sat on the mat", "-n", "100000", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    err = r.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("larqlpy: note: --max-tokens 100,000 capped to")
    room = 512 - rec["prompt_tokens"]
    assert rec["notes"] and len(rec["tokens"]) <= room and f"capped to {room:,}" in err[0]


def test_output_checks_come_before_the_work(world):
    """An unwritable --save-state is refused before any token is generated (it used to fail after
    the whole run, naming a hidden temp file)."""
    r = cli("run", world["tiny"], "the cat", "-n", "50", "--save-state", world["root"] / "no" / "s.kv")
    assert r.returncode == 2 and r.stdout == b""
    assert str(world["root"] / "no" / "s.kv") in r.stderr.decode() and ".tmp" not in r.stderr.decode()
