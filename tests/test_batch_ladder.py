"""larqlpy batch, bench ladder and the Python API."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import make_tiny

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


LINES = [
    {"prompt": "the cat", "id": "first", "max_tokens": 5},
    "this line is not json",
    {"prompt": "the dog", "max_tokens": 4, "continuation": "window/v1"},
    {"prompt": 42},
    {"prompt": "her", "max_tokens": 3, "continuation": "codec/v1", "options": {"bits": 4}},
    {"prompt": "x", "continuation": "codec/v1"},
    {"prompt": "in the", "max_tokens": 6, "temperature": 0.9, "seed": 3, "engine": "no-cache"},
]


def batch(tiny_dir, *args, stdin=None):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in LINES) + "\n"
    return subprocess.run([*EXE, "batch", str(tiny_dir), *args], input=stdin if stdin is not None else text,
                          capture_output=True, text=True, env=ENV, timeout=600)


def test_batch_records_in_input_order_with_errors(tiny_dir, tmp_path):
    r = batch(tiny_dir, "-")
    assert r.returncode == 1  # some lines failed
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5, 6, 7]
    assert [o["error"] is None for o in out] == [True, False, True, False, True, False, True]
    assert out[0]["id"] == "first" and len(out[0]["tokens"]) == 5 and out[2]["engine"] == "window/v1"
    assert out[1]["error"].startswith("line 2: not valid JSON")
    assert "'prompt' must be a string" in out[3]["error"]
    assert "codec/v1 requires option bits" in out[5]["error"]
    assert out[6]["engine"] == "no-cache(canonical/v1)" and len(out[6]["tokens"]) == 6
    assert r.stderr.strip() == "larqlpy: 3 of 7 lines failed"  # no progress bar off a terminal
    # the same answers as `larqlpy run` gives for the same request
    one = subprocess.run([*EXE, "run", str(tiny_dir), "the cat", "-n", "5", "--json"], capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert json.loads(one.stdout)["tokens"] == out[0]["tokens"]


def test_batch_workers_file_output_and_quiet(tiny_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(LINES[i]) for i in (0, 2, 4, 6)) + "\n")  # the good lines
    single = batch(tiny_dir, str(src), "-o", str(tmp_path / "one.jsonl"), stdin="")
    multi = batch(tiny_dir, str(src), "-o", str(tmp_path / "two.jsonl"), "--workers", "2", "--quiet", stdin="")
    assert single.returncode == multi.returncode == 0 and single.stdout == multi.stdout == ""
    a = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b] and len(a) == 4


def test_batch_refusals(tiny_dir, tmp_path):
    r = subprocess.run([*EXE, "batch", str(tiny_dir), str(tmp_path / "missing.jsonl")], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "missing.jsonl" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([*EXE, "batch", str(tmp_path), "-"], input="{}", capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 2 and "no config.json" in r.stderr


def test_no_color_is_honoured():
    code = "import larqlpy.cli.common as m; print(m.err.no_color, m.out.no_color)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**ENV, "NO_COLOR": "1"})
    assert r.stdout.split() == ["True", "True"]


def test_ladder_json_and_plot(tiny_dir, tmp_path):
    png = tmp_path / "ladder.png"
    r = subprocess.run([*EXE, "bench", "ladder", str(tiny_dir), "--positions", "20,40", "--steps", "2", "--json",
                        "--plot", str(png)], capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rows = {(x["engine"], x["positions"]): x for x in d["rows"]}
    assert len(d["rows"]) == 10 and [x["engine"] for x in d["skipped"]] == ["int4-group/v1"]  # head_dim 16 < group
    row = 2 * 2 * 16 * 4  # K+V, 2 KV heads, head_dim 16, f32
    for n in (20, 40):
        c, w = rows[("canonical/v1", n)], rows[("window/v1", n)]
        assert c["row_cosine"] == 1.0 and c["next_token_kl"] == 0.0
        assert w["row_cosine"] == 1.0 and w["next_token_kl"] == 0.0  # bit-identical engine
        # independent accounting: 4 sliding layers hold min(n, 16) rows in rings; 2 global hold n (capacity 256)
        assert w["resident_kv_bytes"] == 4 * min(n, 16) * row + 2 * 256 * row
        q = rows[("codec/v1 [bits=4,calib=off,recent=0,sink=0]", n)]  # the ladder's plain codec
        assert 0.9 < q["row_cosine"] < 1.0 and q["next_token_kl"] > 0
        assert q["resident_kv_bytes"] < w["resident_kv_bytes"]
        assert abs(q["bytes_per_position"] - q["resident_kv_bytes"] / n) < 1e-6
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    width, height = struct.unpack(">II", blob[16:24])
    assert (width, height) == (840, 540)


def test_ladder_refusals(tiny_dir):
    for args, needle in ((["--positions", "a,b"], "comma-separated integers"),
                         (["--plot", "x.svg"], "expected a .png"),
                         (["--engine", "no-cache"], "no-cache keeps no state")):
        r = subprocess.run([*EXE, "bench", "ladder", str(tiny_dir), *args], capture_output=True, text=True,
                           env=ENV, timeout=300)
        assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_python_api_with_engines(tiny_dir):
    import larqlpy
    from larqlpy.engines import PROVIDERS, EngineSpec  # importable

    m = larqlpy.load(tiny_dir, device="cpu")
    a = list(m.generate("the cat", continuation="codec/v1", options={"bits": 4}, max_tokens=5, stop_at_eos=False))
    b = list(m.generate("the cat", engine="turbo-quant:bits=4", max_tokens=5, stop_at_eos=False))
    assert [t.id for t in a] == [t.id for t in b] and a[-1].metrics.resident_kv_bytes > 0
    assert "cells/v1" in PROVIDERS and EngineSpec().identity == "canonical/v1"
    assert larqlpy.GenerationConfig().max_tokens == 64  # the default `larqlpy run -n` shows too


def test_batch_parallel_keeps_input_order_and_equals_one_at_a_time(tiny_dir, tmp_path):
    lines = [{"prompt": "the cat " * (i % 5 + 1), "id": i, "max_tokens": 3 + i % 4, "continuation":
              ["canonical/v1", "window/v1"][i % 2]} for i in range(9)]
    lines.insert(4, {"prompt": "big", "max_tokens": 400})  # more KV (f16 rows beside int8) than the budget: an error
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    one = batch(tiny_dir, str(src), "--parallel", "1", "--weights", "int8", stdin="")
    many = batch(tiny_dir, str(src), "--parallel", "4", "--weights", "int8", "--kv-budget", "300KiB", stdin="")
    two = batch(tiny_dir, str(src), "--parallel", "3", "--workers", "2", "--weights", "int8", stdin="")
    a, b, c = ([json.loads(line) for line in r.stdout.splitlines()] for r in (one, many, two))
    assert [x["line"] for x in b] == list(range(1, 11)) == [x["line"] for x in c]
    assert "budget of 307,200 bytes" in b[4]["error"] and b[4]["error"].startswith("line 5: needs ")
    assert many.returncode == 1 and one.returncode == two.returncode == 0
    for i in (0, 1, 2, 3, 5, 6, 7, 8, 9):
        assert a[i]["tokens"] == b[i]["tokens"] == c[i]["tokens"] and a[i]["id"] == b[i]["id"], i


@pytest.mark.parametrize("args, message", [
    (["--parallel", "0"], "--parallel must be >= 1, got 0"),
    (["--kv-budget", "lots"], "--kv-budget:"),
])
def test_batch_parallel_refusals(tiny_dir, args, message):
    r = batch(tiny_dir, "-", *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1
