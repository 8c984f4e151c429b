"""Batch throughput in one process, in two worker processes, and on 1 and 2 Ray actors of a local
cluster: the same lines through `larqlpy batch`, wall time from the command's start (model loads,
Ray's start included). Asserts nothing.

    python bench/scale_out.py --model models/gemma-3-270m [--lines 32] [--tokens 48] [--weights int8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def main() -> None:
    from stream import cpu_name

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--weights", default="int8")
    args = ap.parse_args()
    qs = [json.loads(line)["question"]
          for line in (ROOT / "larqlpy" / "data" / "questions.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "in.jsonl"
        src.write_text("\n".join(json.dumps({"prompt": f"Question {i}: {qs[i % len(qs)]} Answer:",
                                             "max_tokens": args.tokens, "temperature": 0})
                                 for i in range(args.lines)) + "\n")
        runs = {"one process (--parallel 8)": ["--parallel", "8"],
                "--workers 2 (--parallel 4 each)": ["--workers", "2", "--parallel", "4"],
                "--ray local --actors 1 --actor-cpus 2": ["--ray", "local", "--actors", "1", "--actor-cpus", "2",
                                                          "--parallel", "8"],
                "--ray local --actors 2 --actor-cpus 1": ["--ray", "local", "--actors", "2", "--actor-cpus", "1",
                                                          "--parallel", "4"]}
        print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.lines} lines x {args.tokens} tokens, "
              f"--weights {args.weights}\n")
        print("| run | wall s | generated tokens/s (wall) |\n|---|---|---|")
        for name, extra in runs.items():
            out = Path(d) / "out.jsonl"
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "batch", args.model, str(src), "-o", str(out),
                                "--weights", args.weights, "--quiet", *extra], env=ENV, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                print(f"| {name} | failed: {r.stderr.strip()[-200:]} | |")
                continue
            tokens = sum(len(json.loads(line)["tokens"]) for line in out.read_text().splitlines())
            print(f"| {name} | {wall:.1f} | {tokens / wall:.1f} |")


if __name__ == "__main__":
    main()
