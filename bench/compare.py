"""Two checkouts' benches side by side, in one run: the same bench command in each, taking turns
(old, new, old, new, ...), then every figure of the new one beside the old one's, with the ratio.
Figures are matched by their line: a line's text with its numbers taken out must read the same in
both outputs. Medians over the rounds. Asserts nothing.

    git worktree add /tmp/old 9c0cbb3
    python bench/compare.py --old /tmp/old --rounds 3 -- bench/batch.py --model models/gemma-3-270m --weights int4

Each checkout runs with its own code (PYTHONPATH and the working directory are the checkout) and
this venv's packages; paths in the command that exist here are passed as absolute paths.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d[\d,]*(?:\.\d+)?")  # not inside a name (int4, znver5); none negative


def run(root: Path, command: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, *command], cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{root}: {' '.join(command)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def figures(text: str) -> dict[tuple[str, int], list[float]]:
    """(the line without its numbers, its occurrence) -> its numbers."""
    out, seen = {}, defaultdict(int)
    for line in text.splitlines():
        numbers = [float(n.replace(",", "")) for n in NUMBER.findall(line)]
        if not numbers:
            continue
        skeleton = NUMBER.sub("#", line.strip())
        out[(skeleton, seen[skeleton])] = numbers
        seen[skeleton] += 1
    return out


def medians(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if all(k in r and len(r[k]) == len(runs[0][k]) for r in runs)]
    return {k: [statistics.median(r[k][i] for r in runs) for i in range(len(runs[0][k]))] for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the other checkout (e.g. a git worktree of the old commit)")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the bench script and its arguments")
    args = ap.parse_args()
    command = [str(Path(c).resolve()) if Path(c).exists() and not c.startswith("bench/") else c
               for c in args.command if c != "--"]
    roots = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    outputs: dict[str, list[dict]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for name in ("old", "new"):
            text = run(roots[name], command)
            outputs[name].append(figures(text))
            if i == 0:
                print(f"--- {name} ({roots[name]}), round 1 ---\n{text}", flush=True)
    old, new = medians(outputs["old"]), medians(outputs["new"])
    print(f"--- new, medians of {args.rounds} rounds taking turns; [new / old] where they differ ---")
    for key in new:
        if key not in old or len(old[key]) != len(new[key]) or old[key] == new[key]:
            continue
        parts = iter(f"{n:g}" if n == o else f"{n:g} [{n / o:.2f}x]" if o else f"{n:g} [old 0]"
                     for o, n in zip(old[key], new[key]))
        print("  " + re.sub("#", lambda _: next(parts), key[0]))


if __name__ == "__main__":
    main()
