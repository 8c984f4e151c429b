"""Batched decode: aggregate tokens/s of N sequences in one process, beside one sequence at a time,
two worker processes, and llama.cpp answering the same lines one after another. One run, asserts
nothing.

- scaling: N = 1, 2, 4, 8, 16 sequences (different prompts, `max_tokens` each, EOS ignored so every
  sequence generates all of them) through the scheduler: the aggregate decode rate (tokens after
  every prompt is prefilled / that time) and the end-to-end rate (prefill included). The decode
  curve is written as a plot (PNG) with `--plot`.
- workers: the same 8 sequences as two processes (each loads the model, then runs its half one
  sequence at a time, the way `batch --workers 2` did) -- timed from a barrier after both loaded.
- throughput: 32 lines of 64 tokens through `--parallel 8`, and llama.cpp on the GGUF, one line after
  another.

    python bench/batch.py --model models/gemma-3-270m [--weights int8,int4] [--tokens 64]
        [--plot docs/img/batch-scaling.png]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
SIZES = (1, 2, 4, 8, 16)


def prompts(tokenizer, n: int) -> list[list[int]]:
    qs = [json.loads(line)["question"]
          for line in (ROOT / "larqlpy" / "data" / "questions.jsonl").read_text().splitlines()]
    return [tokenizer.encode(f"Question: {qs[i % len(qs)]}{' Explain.' * (i // len(qs))} Answer:") for i in range(n)]


def sequences(model, ids: list[list[int]], tokens: int):
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence

    gen = GenerationConfig(max_tokens=tokens, stop_at_eos=False)
    return [Sequence(model, p, gen=gen, key=i) for i, p in enumerate(ids)]


def scheduled(loaded, ids, tokens: int, parallel: int, decode_only: bool = False) -> float:
    """Generated tokens/s of `ids` through one scheduler of `parallel` slots: end to end (prefill
    included), or with `decode_only` from the step after which every sequence has its first token
    (the prompts prefilled) to the end -- the aggregate decode rate."""
    from larqlpy.decode.scheduler import Scheduler

    sched = Scheduler(loaded.model, parallel=parallel)
    for seq in sequences(loaded.model, ids, tokens):
        sched.submit(seq)
    t0, n, started = time.perf_counter(), 0, not decode_only
    while not sched.idle():
        got = sum(e.token is not None for e in sched.step())
        if started:
            n += got
        elif all(s.generated for s in sched.live) and not sched.waiting:
            started, t0 = True, time.perf_counter()
    return n / (time.perf_counter() - t0)


def _worker(model: str, weights: str, ids, tokens: int, barrier, out) -> None:
    from larqlpy.weights.loader import load

    import numba

    torch.set_num_threads(1)  # two processes on the two cores, as `batch --workers 2` runs them
    numba.set_num_threads(1)
    loaded = load(model, device="cpu", weights=weights)
    scheduled(loaded, ids[:1], 2, 1)  # JIT and caches warm before the clock starts
    barrier.wait()
    t0 = time.perf_counter()
    n = 0
    for p in ids:  # one sequence at a time, prefill included
        n += tokens
        scheduled(loaded, [p], tokens, 1)
    out.put((n, time.perf_counter() - t0))


def two_workers(model: str, weights: str, ids, tokens: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(model, weights, ids[i::2], tokens, barrier, out)) for i in range(2)]
    for p in procs:
        p.start()
    done = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in done) / max(t for _, t in done)


def llama_lines(gguf: Path, ids, tokens: int) -> float:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)

    def last():
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))

    llm.reset()
    llm.eval(ids[0])
    t0 = time.perf_counter()
    for p in ids:
        llm.reset()
        llm.eval(p)
        tok = last()
        for _ in range(tokens - 1):
            llm.eval([tok])
            tok = last()
    return len(ids) * tokens / (time.perf_counter() - t0)


def main() -> None:
    from decode import gguf_path
    from stream import cpu_name

    from larqlpy.kernels import cpu
    from larqlpy.weights.loader import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="medians of this many runs per size")
    ap.add_argument("--plot", help="write the scaling plot (PNG) here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; kernel features (LLVM): {cpu.describe()}")
    print(f"model {args.model}; {args.tokens} generated tokens per sequence, EOS ignored; canonical/v1; "
          f"medians of {args.repeats}\n")
    curves: dict[str, list[float]] = {}
    for weights in args.weights.split(","):
        loaded = load(args.model, device="cpu", weights=weights)
        ids = prompts(loaded.tokenizer, max(max(SIZES), args.lines))
        scheduled(loaded, ids[:2], 4, 2)  # warm-up
        runs = {n: ([], []) for n in SIZES}
        for _ in range(args.repeats):  # sizes take turns, so a slow spell of the host hits all of them
            for n in SIZES:
                runs[n][0].append(scheduled(loaded, ids[:n], args.tokens, n, decode_only=True))
                runs[n][1].append(scheduled(loaded, ids[:n], args.tokens, n))
        curve = [statistics.median(runs[n][0]) for n in SIZES]
        ends = [statistics.median(runs[n][1]) for n in SIZES]
        curves[weights] = curve
        print(f"--weights {weights}, aggregate decode: " + ", ".join(f"{n} seq {v:.1f} tok/s ({v / curve[0]:.2f}x)"
                                                                 for n, v in zip(SIZES, curve)))
        print("  end to end (prefill included): " + ", ".join(f"{n} seq {v:.1f} tok/s ({v / ends[0]:.2f}x)"
                                                           for n, v in zip(SIZES, ends)))
        del loaded
        workers = two_workers(args.model, weights, ids[:8], args.tokens)
        eight, eight_end = curve[SIZES.index(8)], ends[SIZES.index(8)]
        # each repeat's 8 against its own 1, measured seconds apart: a slow spell of the host that
        # lasts a repeat cancels out of these (one sequence is bound by memory bandwidth, which the
        # host's neighbours move; 8 are compute-bound)
        paired = sorted(a / b for a, b in zip(runs[8][0], runs[1][0]))
        print(f"  8 sequences: aggregate decode {eight:.1f} tok/s = {eight / curve[0]:.2f}x one sequence (each repeat "
              f"against its own: median {statistics.median(paired):.2f}x, range {paired[0]:.2f}-{paired[-1]:.2f}x); "
              f"end to end {eight_end:.1f} tok/s = {eight_end / workers:.2f}x two workers running them one at a time "
              f"({workers:.1f} tok/s, prefill included)")
    gguf = gguf_path(Path(args.model))
    weights = args.weights.split(",")[-1]
    loaded = load(args.model, device="cpu", weights=weights)
    lines = prompts(loaded.tokenizer, args.lines)
    ours = scheduled(loaded, lines, args.tokens, 8)
    print(f"\nthroughput: {args.lines} lines x {args.tokens} tokens, --weights {weights} --parallel 8: "
          f"{ours:.1f} tok/s")
    try:
        theirs = llama_lines(gguf, lines, args.tokens) if gguf is not None else None
    except ImportError:
        theirs = None
    if theirs:
        print(f"  llama.cpp {gguf.name}, one line after another: {theirs:.1f} tok/s -> larqlpy {ours / theirs:.2f}x")
    else:
        print("  llama.cpp: not installed or no GGUF (`make bench` installs llama-cpp-python): left out")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for w, curve in curves.items():
            ax.plot(SIZES, curve, marker="o", label=f"--weights {w}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(SIZES, [str(n) for n in SIZES])
        ax.set_xlabel("sequences in one process")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.set_title(f"{Path(args.model).name}, {cpu_name()}, 2 threads", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
