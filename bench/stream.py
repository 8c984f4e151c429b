"""Streaming cost per token: the token stream over 2,000 generated ids, at its start and at its end.

The layer above the model (`generate.stream_tokens`: detokenizing, a metrics snapshot and a Token per
id) is timed alone, fed real ids of larqlpy/data/long.txt with the 270M's tokenizer, so the model's
own cost (which grows with the context through attention) does not hide it. Beside it, the loop this
replaced: decoding the whole output again for every token. Asserts nothing.

    python bench/stream.py --model models/gemma-3-270m [--tokens 2000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def per_token_times(tokenizer, ids: list[int]) -> list[float]:
    from larqlpy.generate import Metrics, stream_tokens

    logits = torch.zeros(8)
    clock = []

    def steps():
        for i in ids:
            clock.append(time.perf_counter())
            yield i, logits

    times = []
    for tok in stream_tokens(steps(), len(ids), set(), tokenizer.stream(), lambda i: Metrics(decode_tokens=i + 1)):
        times.append(time.perf_counter() - clock[-1])
    return times


def full_redecode_times(tokenizer, ids: list[int]) -> list[float]:
    """The old way: decode everything generated so far, every token."""
    times, decoded = [], ""
    for n in range(1, len(ids) + 1):
        t0 = time.perf_counter()
        full = tokenizer.decode(ids[:n])
        if not full.endswith("\ufffd"):  # the text this token completes, as the old loop emitted it
            _, decoded = full[len(decoded):], full
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    from larqlpy.model.families import read_config
    from larqlpy.model.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    path = Path(args.model)
    tok = Tokenizer.from_dir(path, read_config(path))
    text = (ROOT / "larqlpy" / "data" / "long.txt").read_text()
    ids = tok.encode(text * (1 + args.tokens // 2000))[1:args.tokens + 1]
    window = min(200, len(ids) // 4)
    print(f"streaming {len(ids):,} tokens, {cpu_name()}; per-token microseconds, median of the first and last {window}")
    for name, fn in (("stream_tokens (incremental)", per_token_times), ("full re-decode (before)", full_redecode_times)):
        fn(tok, ids[:50])  # warm-up
        t = fn(tok, ids)
        first, last = statistics.median(t[:window]) * 1e6, statistics.median(t[-window:]) * 1e6
        print(f"  {name:30} start {first:8.1f} us   end {last:8.1f} us   end/start {last / first:5.2f}x")


if __name__ == "__main__":
    main()
