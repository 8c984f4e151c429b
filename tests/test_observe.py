"""Observability: resource curves (--monitor), KV statistics, consistency."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]


def png_size(path: Path) -> tuple[int, int]:
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5_000
    return struct.unpack(">II", blob[16:24])


def test_monitor_on_run_samples_memory_and_position(real_dir, tmp_path):
    data, plot = tmp_path / "m.csv", tmp_path / "m.png"
    r = subprocess.run([*EXE, "run", str(real_dir), "The history of", "-n", "12", "--json", "--monitor", str(data),
                        "--monitor-plot", str(plot)], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = list(csv.DictReader(data.open()))
    assert list(rows[0]) == ["t_s", "position", "rss_bytes", "cuda_allocated_bytes"] and len(rows) >= 3
    t = [float(x["t_s"]) for x in rows]
    assert t == sorted(t)
    assert int(rows[-1]["position"]) == out["prompt_tokens"] + len(out["tokens"])
    # the weights are mapped from the file and every page is read by a forward pass: RSS holds them
    weights = (real_dir / "model.safetensors").stat().st_size
    assert max(int(x["rss_bytes"]) for x in rows) >= 0.9 * weights
    assert png_size(plot) == (840, 480)


def test_monitor_on_batch_counts_lines(tmp_path, real_dir):
    data = tmp_path / "m.json"
    lines = "\n".join(json.dumps({"prompt": p, "max_tokens": 2}) for p in ("a", "b", "c")) + "\n"
    r = subprocess.run([*EXE, "batch", str(real_dir), "-", "--monitor", str(data)], input=lines, capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    samples = json.loads(data.read_text())["samples"]
    assert samples[-1]["position"] == 3 and all(s["rss_bytes"] > 0 for s in samples)


def test_monitor_refusals(real_dir, tmp_path):
    for args, needle in ((["--monitor", str(tmp_path / "m.txt")], "expected a .csv or .json"),
                         (["--monitor-plot", str(tmp_path / "m.png")], "--monitor-plot needs --monitor"),
                         (["--monitor", str(tmp_path / "m.csv"), "--monitor-plot", str(tmp_path / "m.jpg")],
                          "expected a .png")):
        r = subprocess.run([*EXE, "run", str(real_dir), "x", *args], capture_output=True, text=True, env=ENV,
                           timeout=300)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
