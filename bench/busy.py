"""Batched decode on a busy machine: the same lines through `larqlpy batch` at --parallel 8 and 1, on
a quiet machine and beside a one-core background load this bench starts itself (a busy Python
loop), taking turns. A loaded machine should cost throughput in proportion to the cores it takes,
not collapse. Prints each run's time (the whole command, start-up included) and the ratios. Asserts
nothing. One sequence's decode beside llama.cpp under the same loads: bench/busy_decode.py.

    python bench/busy.py --model models/gemma-3-270m [--weights int8] [--lines 24] [--tokens 48] [--repeats 2]
        [--env OMP_WAIT_POLICY=ACTIVE --env ...]   (each --env: one more configuration, run beside the default)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


@contextmanager
def background_load(on: bool):
    """One core kept busy by another process, or nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        time.sleep(0.5 if on else 0)
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def batch_seconds(model: str, weights: str, lines: Path, parallel: int, extra: dict | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra or {})}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "batch", model, str(lines), "--weights", weights,
                    "--parallel", str(parallel), "--quiet"],
                   check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    from stream import cpu_name

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--lines", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE[,KEY=VALUE]: another configuration")
    args = ap.parse_args()
    configs = {"as it is": {}}
    for e in args.env:
        configs[e] = dict(kv.split("=", 1) for kv in e.split(","))
    data = (ROOT / "larqlpy" / "data" / "questions.jsonl").read_text()
    qs = [json.loads(line)["question"] for line in data.splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(tmp) / "in.jsonl"
        lines.write_text("".join(json.dumps({"prompt": f"Question: {qs[i % len(qs)]} Answer:",
                                             "max_tokens": args.tokens, "stop_at_eos": False}) + "\n"
                                 for i in range(args.lines)))
        print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; {args.lines} lines x {args.tokens} tokens, "
              f"--weights {args.weights}; seconds of the whole `larqlpy batch`, medians of {args.repeats}")
        batch_seconds(args.model, args.weights, lines, 8)  # caches warm
        times: dict[tuple, list[float]] = {}
        for _ in range(args.repeats):  # every configuration, quiet and loaded, takes turns
            for name, extra in configs.items():
                for loaded in (False, True):
                    for parallel in (8, 1):
                        with background_load(loaded):
                            times.setdefault((name, parallel, loaded), []).append(
                                batch_seconds(args.model, args.weights, lines, parallel, extra))
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in configs:
            print(f"{name}:")
            for loaded in (False, True):
                a, b = med[(name, 8, loaded)], med[(name, 1, loaded)]
                print(f"  {'one core busy' if loaded else 'quiet':14} --parallel 8: {a:6.1f} s   "
                      f"--parallel 1: {b:6.1f} s   --parallel 8 is {b / a:.2f}x")
            print(f"  loaded / quiet: --parallel 8 {med[(name, 8, True)] / med[(name, 8, False)]:.2f}x the time, "
                  f"--parallel 1 {med[(name, 1, True)] / med[(name, 1, False)]:.2f}x")


if __name__ == "__main__":
    main()
