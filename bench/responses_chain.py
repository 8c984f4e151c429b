"""A ten-turn Responses API chain on kept KV state, against a live server on 127.0.0.1 it starts:
each turn's time to first token (streamed), its prompt and the tokens its previous response's state
held, beside a chat-completions client that sends the whole conversation each turn (which the kept
states serve too); the ratio of turn 10's time to first token to turn 2's, medians over the rounds.
Asserts nothing.

    python bench/responses_chain.py --model models/qwen2.5-coder-0.5b-instruct [--rounds 3] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serving import Server  # noqa: E402

QUESTIONS = ["Write a Python function that reverses a string.", "Now make it skip spaces.",
             "Add a docstring.", "Add type hints.", "Write a test for it.", "Make the test use pytest.",
             "Add a second test for an empty string.", "Rename the function to flip.",
             "Explain the function in one sentence.", "Thank you!"]
INSTRUCTIONS = "You are a concise coding assistant."


def first_token(url: str, path: str, body: dict) -> tuple[float, dict]:
    """Seconds to the first streamed text, and the last event's data."""
    t0, first, last = time.perf_counter(), None, {}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if first is None and event.get("type") == "response.output_text.delta":
                first = time.perf_counter() - t0
            last = event
    return (first if first is not None else time.perf_counter() - t0), last


def chain(url: str, model: str, tokens: int, system: str) -> list[dict]:
    """The Responses chain: each turn names the previous response and sends only its new input."""
    rows, previous = [], None
    for q in QUESTIONS:
        body = {"model": model, "input": q, "instructions": system, "previous_response_id": previous,
                "max_output_tokens": tokens, "temperature": 0}
        t, last = first_token(url, "/v1/responses", body)
        r = last["response"]
        rows.append({"ttft": t, "input": r["usage"]["input_tokens"],
                     "cached": r["usage"]["input_tokens_details"]["cached_tokens"]})
        previous = r["id"]
    return rows


def chat_chain(url: str, model: str, tokens: int, system: str) -> list[float]:
    """The same conversation as chat completions, the whole of it sent each turn (kept states serve it too)."""
    out, messages = [], [{"role": "system", "content": system}]
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        text, t0, first = "", time.perf_counter(), None
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
                "model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    piece = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter() - t0
                        text += piece
        out.append(first)
        messages.append({"role": "assistant", "content": text})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    with Server(Path(a.model), "--weights", a.weights, "--parallel", "1") as s:
        name = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
        chain(s.url, name, 2, "warm-up")  # the kernels compiled, the first request's costs paid
        rounds, chats = [], []
        for i in range(a.rounds):  # each round and each API its own system prompt: no state of another serves it
            rounds.append(chain(s.url, name, a.tokens, f"{INSTRUCTIONS} (round {i}, responses)"))
            chats.append(chat_chain(s.url, name, a.tokens, f"{INSTRUCTIONS} (round {i}, chat)"))
    print(f"model {a.model}, weights {a.weights}, {a.tokens} tokens a turn, median of {a.rounds} chains")
    print("turn  prompt  cached  ttft_responses_ms  ttft_chat_whole_ms")
    med = []
    for k in range(len(QUESTIONS)):
        t = statistics.median(r[k]["ttft"] for r in rounds)
        c = statistics.median(r[k] for r in chats)
        med.append(t)
        first = rounds[0][k]
        print(f"{k + 1:4d}  {first['input']:6d}  {first['cached']:6d}  {t * 1000:17.1f}  {c * 1000:18.1f}")
    print(f"turn 10 / turn 2 time to first token: {med[9] / med[1]:.2f}x")


if __name__ == "__main__":
    main()
