"""The chat-completions path through `larqlpy serve`, as a client sees it: time to first token and
decode tokens per second of streamed chat completions (different short questions, one client at a
time), medians. The server is the code of the working directory (PYTHONPATH=.), so
bench/compare.py can hold two checkouts side by side with this one file:

    python bench/compare.py --old /tmp/old --rounds 3 -- $PWD/bench/chat_path.py --model models/MODEL

Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

QUESTIONS = ["Write a haiku about rust.", "What is a closure?", "Name three sorting algorithms.",
             "Explain recursion briefly.", "What does git rebase do?", "Give a regex for an email address.",
             "What is a monad?", "Why use type hints?"]


def start(model: str, weights: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "larqlpy.cli.main", "serve", model, "--port", str(port),
                             "--weights", weights, "--parallel", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not come up")


def one(url: str, name: str, question: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens per second after it)."""
    body = {"model": name, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, first, n = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    proc, url = start(str(Path(a.model).resolve()), a.weights)
    try:
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        one(url, name, "Hello", 4)  # kernels compiled, first costs paid
        runs = [one(url, name, q, a.tokens) for q in QUESTIONS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"chat completions, {a.tokens} tokens, {len(QUESTIONS)} questions, one client")
    print(f"time to first token ms {statistics.median(r[0] for r in runs) * 1000:.1f}")
    print(f"decode tok/s {statistics.median(r[1] for r in runs):.2f}")


if __name__ == "__main__":
    main()
