"""Batch runs past one process: resumable output, shards and batch-merge, Ray actors on a local
cluster on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import make_tiny

# RAY_AUTH_MODE: a token left in ~/.ray by an earlier local cluster must not decide whether the
# test cluster on 127.0.0.1 wants one
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "RAY_AUTH_MODE": "disabled"}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]
LINES = [{"prompt": "the cat " * (i % 4 + 1), "id": f"r{i}", "max_tokens": 6 + i % 5,
          "continuation": ["canonical/v1", "window/v1"][i % 2]} for i in range(14)]
LINES[5] = {"prompt": 7}  # a bad line: an error record


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    make_tiny(d / "tiny", sliding_window=16)
    src = d / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in LINES) + "\n\n")  # a blank line at the end
    ref = subprocess.run([*EXE, "batch", str(d / "tiny"), str(src), "-o", str(d / "ref.jsonl"), "--weights", "int8"],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert ref.returncode == 1, ref.stderr  # the bad line
    return d


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same(a: list[dict], b: list[dict]) -> bool:
    """Record for record, apart from timings."""
    def strip(r):
        return {k: v for k, v in r.items() if k != "stats"}
    return [strip(r) for r in a] == [strip(r) for r in b]


def batch(world, *args, timeout=600):
    return subprocess.run([*EXE, "batch", str(world / "tiny"), str(world / "in.jsonl"), "--weights", "int8", *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout)


def test_records_carry_line_and_hash(world):
    out = records(world / "ref.jsonl")
    assert [r["line"] for r in out] == list(range(1, 15)) and all(len(r["line_hash"]) == 16 for r in out)
    assert out[5]["error"].startswith("line 6: 'prompt' must be a string")


def test_resume_after_kills_at_random_moments_equals_an_uninterrupted_run(world):
    out = world / "resumed.jsonl"
    rng = random.Random(3)
    for kill in range(3):
        p = subprocess.Popen([*EXE, "batch", str(world / "tiny"), str(world / "in.jsonl"), "--weights", "int8",
                              "-o", str(out), "--resume-output", "--parallel", "2"], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 6.0))  # model load, then a few lines done
        p.send_signal(signal.SIGKILL)
        p.wait()
    if out.exists():  # a record cut off mid-write, as a crash would leave it
        with open(out, "a") as f:
            f.write('{"id": "r9", "line": 10, "text": "hal')
    r = batch(world, "-o", str(out), "--resume-output")
    assert r.returncode == 1, r.stderr  # the bad line, as a plain run
    got = records(out)
    assert same(got, records(world / "ref.jsonl")) and len({g["line"] for g in got}) == len(got)


def test_an_edited_line_is_run_again(world, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text((world / "ref.jsonl").read_text())
    edited = tmp_path / "in.jsonl"
    lines = (world / "in.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"prompt": "a different line", "id": "new", "max_tokens": 3})
    edited.write_text("\n".join(lines) + "\n")
    r = subprocess.run([*EXE, "batch", str(world / "tiny"), str(edited), "--weights", "int8", "-o", str(out),
                        "--resume-output"], capture_output=True, text=True, env=ENV, timeout=600)
    got = records(out)
    assert r.returncode == 1 and got[2]["id"] == "new" and len(got[2]["tokens"]) == 3
    assert same(got[:2] + got[3:], records(world / "ref.jsonl")[:2] + records(world / "ref.jsonl")[3:])


def test_three_shards_merged_equal_one_run(world, tmp_path):
    for i in range(3):
        r = batch(world, "-o", str(tmp_path / f"part.{i}"), "--shard", f"{i}/3")
        assert r.returncode in (0, 1), r.stderr
    shards = [str(tmp_path / f"part.{i}") for i in range(3)]
    merge = subprocess.run([*EXE, "batch-merge", *shards, "-o", str(tmp_path / "all.jsonl"), "--input",
                            str(world / "in.jsonl")], capture_output=True, text=True, env=ENV, timeout=120)
    assert merge.returncode == 1  # the bad line's record is an error, as in one run
    assert same(records(tmp_path / "all.jsonl"), records(world / "ref.jsonl"))
    missing = subprocess.run([*EXE, "batch-merge", *shards[:2], "-o", str(tmp_path / "x.jsonl"), "--input",
                              str(world / "in.jsonl")], capture_output=True, text=True, env=ENV, timeout=120)
    assert missing.returncode == 2 and "have no record in these shards" in missing.stderr
    twice = subprocess.run([*EXE, "batch-merge", *shards, shards[0], "-o", str(tmp_path / "y.jsonl"), "--input",
                            str(world / "in.jsonl")], capture_output=True, text=True, env=ENV, timeout=120)
    assert twice.returncode == 2 and "has a record in both" in twice.stderr


@pytest.mark.parametrize("args, message", [
    (["--shard", "3/3"], "--shard: I/N needs N >= 1 and 0 <= I < N"),
    (["--shard", "x"], "--shard: expected I/N"),
    (["--resume-output"], "--resume-output needs -o"),
    (["--actors", "2"], "--actors, --actor-cpus and --worker-model go with --ray"),
])
def test_refusals(world, args, message):
    r = batch(world, *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    pytest.importorskip("ray")
    from serving import free_port

    port = free_port()
    tmp = tmp_path_factory.mktemp("ray")
    start = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                            "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                            f"--temp-dir={tmp}"], capture_output=True, text=True, env=ENV, timeout=180)
    assert start.returncode == 0, start.stderr
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process joins it too (the kill test)
    yield f"127.0.0.1:{port}"
    if before is None:
        os.environ.pop("RAY_AUTH_MODE")
    else:
        os.environ["RAY_AUTH_MODE"] = before
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, env=ENV,
                   timeout=120)


def test_ray_actors_give_the_local_records(world, ray_cluster, tmp_path):
    out = tmp_path / "ray.jsonl"
    r = batch(world, "-o", str(out), "--ray", ray_cluster, "--actors", "2", "--actor-cpus", "1")
    assert r.returncode == 1, r.stderr
    assert same(records(out), records(world / "ref.jsonl"))


def test_a_killed_actor_loses_and_duplicates_nothing(world, ray_cluster, tmp_path):
    import ray

    out = tmp_path / "ray.jsonl"
    slow = tmp_path / "slow.jsonl"
    slow.write_text("\n".join(json.dumps({**line, "max_tokens": 60}) if "max_tokens" in line else json.dumps(line)
                              for line in LINES) + "\n")
    p = subprocess.Popen([*EXE, "batch", str(world / "tiny"), str(slow), "--weights", "int8", "-o", str(out),
                          "--ray", ray_cluster, "--actors", "2", "--parallel", "2"], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ray.init(address=ray_cluster, namespace="larqlpy", log_to_driver=False)
    try:
        killed = None
        for _ in range(600):
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("batch-")]
            if names:
                time.sleep(0.5)  # while it loads the model or runs its first chunk
                killed = sorted(names)[0]
                ray.kill(ray.get_actor(killed, namespace="larqlpy"), no_restart=True)
                break
            time.sleep(0.1)
    finally:
        ray.shutdown()
    stdout, stderr = p.communicate(timeout=600)
    assert killed and p.returncode == 1, stderr
    assert f"Ray actor {killed} died: replaced" in stderr
    got = records(out)
    local = subprocess.run([*EXE, "batch", str(world / "tiny"), str(slow), "--weights", "int8"], capture_output=True,
                           text=True, env=ENV, timeout=600)
    assert [g["line"] for g in got] == list(range(1, 15))
    assert same(got, [json.loads(line) for line in local.stdout.splitlines()])
