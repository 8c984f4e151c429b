"""Streaming cost per token: the token stream over 2,000 generated ids, at its start and at its end.

The layer above the model (`Sequence.feed`: sampling, detokenizing, stop strings, a metrics snapshot
and a Token per id) is timed alone, fed logits that pick the real ids of larqlpy/data/long.txt with
the 270M's tokenizer, so the model's own cost (which grows with the context through attention) does
not hide it; with and without stop strings to watch for. Beside it, the loop the incremental
detokenizer replaced: decoding the whole output again for every token. Asserts nothing.

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


class NoLayers:
    """A model of no layers: what a sequence asks of it beside the forward pass, which is not timed."""

    device = torch.device("cpu")

    def geometries(self):
        return []


def sequence_times(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> list[float]:
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence

    seq = Sequence(NoLayers(), [0], gen=GenerationConfig(max_tokens=len(ids) + 1, stop=stop), tokenizer=tokenizer)
    seq.start()
    logits = torch.zeros(1, tokenizer.vocab_size)
    times, prev = [], 0
    for i in ids:
        logits[0, prev], logits[0, i], prev = 0.0, 1.0, i  # argmax picks i
        t0 = time.perf_counter()
        seq.feed(logits)
        times.append(time.perf_counter() - t0)
    return times


def per_token_times(tokenizer, ids: list[int]) -> list[float]:
    return sequence_times(tokenizer, ids)


def with_stop_strings(tokenizer, ids: list[int]) -> list[float]:
    return sequence_times(tokenizer, ids, ("\n\nQuestion:", "THE END"))


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
    from larqlpy.text.tokenizer import Tokenizer

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
    for name, fn in (("Sequence.feed (incremental)", per_token_times), ("  with 2 stop strings", with_stop_strings),
                     ("full re-decode (before)", full_redecode_times)):
        fn(tok, ids[:50])  # warm-up
        t = fn(tok, ids)
        first, last = statistics.median(t[:window]) * 1e6, statistics.median(t[-window:]) * 1e6
        print(f"  {name:30} start {first:8.1f} us   end {last:8.1f} us   end/start {last / first:5.2f}x")


if __name__ == "__main__":
    main()
