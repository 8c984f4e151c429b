"""`larqlpy serve --ray` against one server: concurrent conversations of several turns each through
the `openai` client (greedy), on servers this script starts on 127.0.0.1. Asserts nothing.

Runs, each on a fresh server:

- single: `larqlpy serve` with 1 thread (OMP/NUMBA_NUM_THREADS=1), all conversations, streamed;
  then half of them (other conversations) -- the time to first token at the load one replica of
  two sees;
- ray 1, ray 2: `--ray local --replicas N --replica-cpus 1`, all conversations, streamed;
- kill: `--ray local --replicas 2`, not streamed, one replica killed (`ray.kill`) once the first
  turns are in; every answer compared with the ray 2 run's.

For each: generated tokens/s (wall), time to first token p50, follow-up turns whose
`cached_tokens` hold all the earlier turns' tokens, the router's hits (GET /router), failed
requests, and whether every answer equals the single server's.

    python bench/serve_ray.py [--model models/smollm2-135m-instruct] [--weights int8] \
        [--conversations 16] [--turns 4] [--max-tokens 32] [--parallel 8] [--runs single,ray1,ray2,kill]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serving import free_port  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
ONE_THREAD = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
ANNOUNCE = re.compile(r"on (http://\S+) \(pid")
CLUSTER = re.compile(r"cluster (\S+),")
TOPICS = ["oceans", "volcanoes", "bread", "bicycles", "comets", "bees", "glass", "rivers", "clocks", "deserts",
          "violins", "forests", "bridges", "tea", "maps", "whales"]
FOLLOW_UPS = ["Tell me one more fact.", "Why does that matter?", "Say it more simply.", "Give an example."]


class Launched:
    """A `larqlpy serve` subprocess: its URL, and its Ray cluster's address when it runs one."""

    def __init__(self, model: str, *args: str, env: dict | None = None, timeout: float = 600):
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "larqlpy.cli.main", "serve", model, "--port", str(port),
                                      *args], env={**ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.url, self.cluster = f"http://127.0.0.1:{port}", None
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("larqlpy serve did not come up:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        announced = ""
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("larqlpy: serving") or announced:
                announced += line  # the announcement may wrap
                if "(pid" in announced:
                    m = CLUSTER.search(announced.replace("\n", ""))
                    self.cluster = m.group(1) if m else None
                    self.ready.set()
                    announced = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Turn:
    text: str
    prompt: int
    completion: int
    cached: int
    ttft: float | None


async def conversation(client, model: str, i: int, turns: int, max_tokens: int, stream: bool,
                       progress: list) -> list[Turn | str]:
    """Conversation `i`: its turns, or an error's text where one failed (the conversation stops)."""
    messages = [{"role": "system", "content": f"Conversation {i}. Answer in one short sentence."},
                {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
    out: list[Turn | str] = []
    for t in range(turns):
        t0 = time.perf_counter()
        kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        try:
            if stream:
                text, first, usage = "", None, None
                async for chunk in await client.chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first if first is not None else time.perf_counter() - t0
                        text += chunk.choices[0].delta.content
                    usage = chunk.usage or usage
            else:
                r = await client.chat.completions.create(**kw)
                text, first, usage = r.choices[0].message.content, None, r.usage
        except Exception as e:  # a failed request is counted, not raised
            out.append(f"{type(e).__name__}: {e}")
            return out
        out.append(Turn(text, usage.prompt_tokens, usage.completion_tokens,
                        usage.prompt_tokens_details.cached_tokens, first))
        progress.append((i, t))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UPS[t % 4]}]
    return out


def replica_killer(cluster: str):
    """Joins the cluster now (a second or so), and returns what kills one replica at once."""
    import ray

    ray.init(address=cluster, log_to_driver=False)

    def kill() -> str:
        try:
            names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                           if "#replica#" in a["name"])
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            return names[0]
        finally:
            ray.shutdown()
    return kill


async def run(server: Launched, model: str, ids: range, turns: int, max_tokens: int, stream: bool,
              kill_after: int | None = None) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    progress: list = []

    kill = await asyncio.to_thread(replica_killer, server.cluster) if kill_after is not None else None

    async def killer():
        while len(progress) < kill_after:
            await asyncio.sleep(0.01)
        return await asyncio.to_thread(kill)

    t0 = time.perf_counter()
    killing = asyncio.create_task(killer()) if kill_after is not None else None
    convs = await asyncio.gather(*(conversation(client, model, i, turns, max_tokens, stream, progress) for i in ids))
    wall = time.perf_counter() - t0
    killed = await killing if killing is not None else None
    return summary(convs, wall, server, killed)


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
