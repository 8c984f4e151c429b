"""`larqlpy serve --ray` against one server: concurrent conversations of several turns each through
the `openai` client (greedy), on servers this script starts on 127.0.0.1. Asserts nothing.

Runs, each on a fresh server:

- single: `larqlpy serve` with 1 thread (OMP/NUMBA_NUM_THREADS=1), all conversations, streamed;
  then half of them (other conversations) -- the time to first token at the load one replica of
  two sees;
- ray 1, ray 2: `--ray local --replicas N --replica-cpus 1`, all conversations, streamed;
- kill: `--ray local --replicas 2`, not streamed, one replica killed (`ray.kill`) once the first
  turns are in; every answer compared with the ray 2 run's.

Each server first answers 4 other conversations' first turns (its kernels loaded), unmeasured. For
each: generated tokens/s (wall), time to first token p50, follow-up turns whose
`cached_tokens` hold all the earlier turns' tokens, the router's hits (GET /router), failed
requests, and whether every answer equals the single server's.

    python bench/serve_ray.py [--model models/smollm2-135m-instruct] [--weights int8] \
        [--conversations 16] [--turns 4] [--max-tokens 32] [--parallel 8] [--runs single,ray1,ray2,kill]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conversations import Launched, Turn, converse  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


async def run(server: Launched, model: str, ids: range, turns: int, max_tokens: int, stream: bool,
              kill_after: int | None = None) -> dict:
    t0 = time.perf_counter()
    convs, killed = await converse(server, model, ids, turns, max_tokens, stream, kill_after)
    return summary(convs, time.perf_counter() - t0, server, killed)


def summary(convs: list[list], wall: float, server: Launched, killed: str | None) -> dict:
    turns = [t for c in convs for t in c if isinstance(t, Turn)]
    failed = sum(1 for c in convs for t in c if isinstance(t, str))
    follow = [(a, b) for c in convs for a, b in zip(c, c[1:]) if isinstance(a, Turn) and isinstance(b, Turn)]
    held = sum(1 for a, b in follow if b.cached >= a.prompt + a.completion - 1)
    firsts = [t.ttft for t in turns if t.ttft is not None]
    router = httpx.get(server.url + "/router", timeout=10).json() if server.cluster else None
    return {"wall_s": round(wall, 2), "tokens_per_s": round(sum(t.completion for t in turns) / wall, 1),
            "ttft_p50_s": round(statistics.median(firsts), 3) if firsts else None,
            "follow_ups_with_all_earlier_tokens": f"{held}/{len(follow)}", "router": router, "failed": failed,
            "killed": killed, "texts": [[t.text if isinstance(t, Turn) else None for t in c] for c in convs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--runs", default="single,ray1,ray2,kill")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    name, n, runs = Path(a.model).name, a.conversations, a.runs.split(",")
    common = ["--weights", a.weights, "--parallel", str(a.parallel)]
    results = {}

    def on(args, env=None):
        return Launched(a.model, *common, *args, env=env)

    for what in runs:
        ray = ["--ray", "local", "--replica-cpus", "1"]
        server = on([], ONE_THREAD) if what == "single" else \
            on(ray + ["--replicas", "1" if what == "ray1" else "2"])
        try:
            # warm: each replica's first requests load its compiled kernels (seconds), not measured
            asyncio.run(converse(server, name, range(300, 304), 1, 8, True))
            stream = what != "kill"
            results[what] = asyncio.run(run(server, name, range(n), a.turns, a.max_tokens, stream,
                                            kill_after=n + 2 if what == "kill" else None))
            if what == "single":
                results["single-half"] = asyncio.run(run(server, name, range(100, 100 + n // 2), a.turns,
                                                         a.max_tokens, True))
        finally:
            server.stop()
    report(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def report(results: dict) -> None:
    base = results.get("single", {})
    print("| run | tokens/s | vs single | TTFT p50 s | follow-ups holding all earlier tokens | router hits | "
          "failed | answers = single's |")
    print("|---|---|---|---|---|---|---|---|")
    for what, r in results.items():
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and what != "single-half" else ""
        same = "" if what == "single-half" or not base else str(r["texts"] == base["texts"])
        hits = f"{r['router']['hit']}/{r['router']['hit'] + r['router']['moved']}" if r["router"] else ""
        print(f"| {what} | {r['tokens_per_s']} | {ratio} | {r['ttft_p50_s']} | "
              f"{r['follow_ups_with_all_earlier_tokens']} | {hits} | {r['failed']} | {same} |")
    if "kill" in results and "ray2" in results:
        same = results["kill"]["texts"] == results["ray2"]["texts"]
        print(f"{results['kill']['killed']} killed; answers = the ray 2 run's: {same}")
    if "ray2" in results and "single-half" in results and results["ray2"]["ttft_p50_s"]:
        print(f"time to first token p50, ray 2 replicas / single at half the load: "
              f"{results['ray2']['ttft_p50_s'] / results['single-half']['ttft_p50_s']:.2f}x")


if __name__ == "__main__":
    main()
