"""`larqlpy serve` under load, against a live server on 127.0.0.1 it starts. Asserts nothing.

- prefix reuse: time to first token of a request over a ~1,000-token document (cold: nothing kept
  shares it) and of a second request over the same document with another question (warm: the
  first's kept state holds the document), 3 documents; the ratio of the medians.
- load: a fixed count of completion requests (different short prompts, `--tokens` each) from 1, 4
  and 8 concurrent clients (an asyncio httpx loop): throughput and p50 / p99 latency.

    python bench/serve.py --model models/gemma-3-270m [--weights int8] [--requests 24] [--tokens 32]
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def ttft(url: str, model: str, prompt: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the server reports."""
    t0 = time.perf_counter()
    first, cached = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if "larqlpy" in event:
                cached = event["larqlpy"]["cached_tokens"]
    return first if first is not None else time.perf_counter() - t0, cached


async def load(url: str, model: str, clients: int, prompts: list[str], tokens: int) -> dict:
    latencies, done = [], 0
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def client(http: httpx.AsyncClient):
        nonlocal done
        while not queue.empty():
            p = queue.get_nowait()
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": tokens,
                                                               "temperature": 0}, timeout=600)
            latencies.append(time.perf_counter() - t0)
            done += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"clients": clients, "requests": len(lat), "tok_s": done / wall, "p50": lat[len(lat) // 2],
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "wall": wall}


def main() -> None:
    from serving import Server
    from stream import cpu_name

    from larqlpy.weights.loader import load as load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    model = Path(args.model).resolve().name
    tok = load_model(args.model, device="cpu").tokenizer
    words = (ROOT / "larqlpy" / "data" / "long.txt").read_text().split()
    print(f"CPU: {cpu_name()}; model {model}, --weights {args.weights}, default --parallel")
    with Server(Path(args.model), "--weights", args.weights) as s:
        ttft(s.url, model, "Hello")  # warm-up: JIT, caches
        cold, warm = [], []
        for i in range(3):
            doc = " ".join(words[i * 600:i * 600 + 900])
            while len(tok.encode(doc)) > 1000:
                doc = doc.rsplit(" ", 20)[0]
            a = ttft(s.url, model, f"{doc}\n\nQuestion: what is this text about? Answer:")
            b = ttft(s.url, model, f"{doc}\n\nQuestion: who wrote it? Answer:")
            cold.append(a[0])
            warm.append(b[0])
            print(f"  document {i + 1} ({len(tok.encode(doc))} tokens): cold {a[0] * 1e3:.0f} ms, "
                  f"warm {b[0] * 1e3:.0f} ms ({b[1]} cached tokens)")
        ratio = statistics.median(cold) / statistics.median(warm)
        print(f"prefix reuse: time to first token cold {statistics.median(cold) * 1e3:.0f} ms, warm "
              f"{statistics.median(warm) * 1e3:.0f} ms -> {ratio:.1f}x shorter")
        qs = [json.loads(line)["question"]
              for line in (ROOT / "larqlpy" / "data" / "questions.jsonl").read_text().splitlines()]
        prompts = [f"Question {i}: {qs[i % len(qs)]} Answer:" for i in range(args.requests)]
        print(f"\nload: {args.requests} requests of {args.tokens} tokens each\n")
        print("| clients | requests | tokens/s | p50 latency s | p99 latency s |\n|---|---|---|---|---|")
        for c in (1, 4, 8):
            r = asyncio.run(load(s.url, model, c, prompts, args.tokens))
            print(f"| {c} | {r['requests']} | {r['tok_s']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} |")


if __name__ == "__main__":
    main()
