"""Observability: resource curves (--monitor), KV statistics, consistency."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_kv_stats_against_an_independent_computation(real, real_dir, long_text, tmp_path):
    import numpy as np
    import torch

    from larqlpy.engines import EngineSpec, new_state
    from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec
    from larqlpy.tools.observe import kv_stats
    from larqlpy.engines.lifecycle import parse_rules

    ids = real.tokenizer.encode(long_text)[:600]
    first = kv_stats(real, ids, min_cosine=0.0)
    worst = sorted(min(e[t]["cosine"]["tq4"]["mean"] for t in ("K", "V")) for e in first["layers"])
    threshold = worst[len(worst) // 2]  # half the layers fall below it
    r = kv_stats(real, ids, min_cosine=threshold)
    expect_bad = [e["layer"] for e in r["layers"] if min(e[t]["cosine"]["tq4"]["mean"] for t in ("K", "V")) < threshold]
    assert r["keep_exact"] == expect_bad and 0 < len(expect_bad) < 18
    policy = parse_rules(r["rules"], "suggested").policy  # the cells engine reads what kv-stats writes
    assert policy.quantize_layers == tuple(i for i in range(18) if i not in expect_bad)
    # recompute layer 3's K statistics with numpy and the torch codec
    state = new_state(EngineSpec(), real.model.geometries(), real.device)
    real.model(torch.tensor(ids), state)
    k = state.layers[3].read(0, torch.float32)[0].reshape(-1, 256)
    kn = k.numpy()
    st = r["layers"][3]["K"]
    assert st["min"] == float(kn.min()) and st["max"] == float(kn.max())
    chan = np.abs(kn).max(0)
    assert st["outlier_channels"] == int((chan > 4.0 * np.median(chan)).sum())
    codec = TorchCodec(256, 4, torch.device("cpu"))
    cos = torch.nn.functional.cosine_similarity(k, codec.decode(*codec.encode(k)), dim=-1)
    assert abs(st["cosine"]["tq4"]["mean"] - cos.mean().item()) < 1e-5
    assert abs(st["quantiles"]["0.5"] - float(np.quantile(kn, 0.5))) < 1e-3
    # attention KL at 4 bits: the key calibration (make model writes one) tames the global layers,
    # whose keys carry the largest common component; without it kv-stats asks for wider keys there
    assert r["calibrated"]
    saved, real.model.key_calibration = real.model.key_calibration, None
    try:
        plain = kv_stats(real, ids)
    finally:
        real.model.key_calibration = saved
    assert not plain["calibrated"]
    for i in (5, 11):
        assert r["layers"][i]["attention_kl"]["tq4"] * 5 < plain["layers"][i]["attention_kl"]["tq4"]
        assert f"{i}:8/4" in plain["layer_bits"].split(",")
    # and the command writes the rules file
    out = subprocess.run([*EXE, "kv-stats", str(real_dir), "-", "--max-positions", "300", "--json", "--rules-out",
                          str(tmp_path / "r.yaml")], input=long_text, capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["positions"] == 300 and parse_rules((tmp_path / "r.yaml").read_text(), "r")


def test_consistency_against_an_independent_run(real, real_dir, tmp_path):
    from larqlpy.engines import EngineSpec, parse_engine_spec
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.stream import stream_generate
    from larqlpy.tools.observe import consistency, load_questions

    qfile = tmp_path / "q.jsonl"
    qfile.write_text('{"id": "a", "question": "What is the capital of France?"}\n'
                     '{"id": "b", "question": "Who wrote Romeo and Juliet?"}\n')
    questions = load_questions(qfile)
    codec = parse_engine_spec(continuation="codec/v1", options=["bits=3"])
    r = consistency(real, questions, [parse_engine_spec(continuation="window/v1"), codec], max_tokens=6)
    window, coded = r["engines"]
    assert window["exact_match_rate"] == 1.0 and window["mean_kl"] == 0.0 and window["mean_common_prefix"] == 6
    prefixes = []
    for q in questions:  # recompute the common prefix by running both engines here
        ids = real.tokenizer.encode(q["prompt"])
        cfg = GenerationConfig(max_tokens=6, stop_at_eos=False)
        a = [t.id for t in stream_generate(real.model, ids, EngineSpec(), cfg)]
        b = [t.id for t in stream_generate(real.model, ids, codec, cfg)]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 6))
    assert [p["common_prefix"] for p in coded["per_question"]] == prefixes
    assert coded["mean_common_prefix"] == sum(prefixes) / 2 and coded["mean_kl"] > 0
    assert r["reference"]["a"].strip().startswith("Paris")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    r = subprocess.run([*EXE, "bench", "consistency", str(real_dir), str(bad)], capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 2 and "bad.jsonl:1: expected an object with a 'question'" in r.stderr


def test_shipped_question_set():
    from larqlpy.tools.observe import load_questions

    qs = load_questions()
    assert 20 <= len(qs) <= 50 and len({q["id"] for q in qs}) == len(qs)


@pytest.mark.heavy  # the 270M to 4,096 positions twice; CI keeps the ladder's tiny-model tests
def test_ladder_confirms_capacity_by_running(real_dir):
    def run(identity):
        r = subprocess.run([*EXE, "bench", "ladder", str(real_dir), "--budget", "96MiB", "--max-positions", "4096",
                            "--continuation", identity, "--json"], capture_output=True, text=True, env=ENV, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["rows"][0]

    canonical, window = run("canonical/v1"), run("window/v1")
    budget = 96 * 2**20
    assert canonical["accounted_positions"] == budget // (18 * 2048)
    assert window["accounted_positions"] == (budget - 15 * 512 * 2048) // (3 * 2048)
    # canonical's rows alone pass the budget when its buffer doubles past 2,048 rows (151 MiB)
    assert canonical["reached_budget"] and \
        0 < canonical["fits_positions"] <= min(2048, canonical["accounted_positions"])
    assert canonical["peak_growth_bytes"] > budget  # what stopped it was measured, rows + transients
    # the window holds 512 rows per sliding layer: it runs well past canonical on the same budget
    assert window["fits_positions"] > canonical["fits_positions"]
    assert window["fits_positions"] <= window["accounted_positions"]
