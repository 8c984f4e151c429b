"""The CPU decode-attention kernel (kernels/attention/decode.py) alone, and inside a whole decode step,
optionally beside another copy of that file (an older commit's) loaded into the same process, the
two taking turns call by call so a noisy host slows both alike.

    python bench/attention.py --shape 14,2,64 --rows 300,1100,4000 [--kv f16] [--threads 1]
    git show HEAD~1:larqlpy/kernels/attention/decode.py > /tmp/old_attention.py
    python bench/attention.py --against /tmp/old_attention.py --rows 1100,4000
    python bench/attention.py --against /tmp/old_attention.py --step models/gguf/qwen2.5-coder-0.5b-instruct.gguf \\
        --positions 1024 --weights native

Kernel mode prints each copy's median and minimum µs a call (the Python wrapper included) and the
new copy's multiply-adds per nanosecond; step mode prefills two states alike, then times decode steps
alternating between the copies, each on its own state. For a fair comparison run it with a fresh
NUMBA_CACHE_DIR, so both copies are compiled in this process. Asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from decode import Larqlpy  # noqa: E402
from stream import cpu_name  # noqa: E402

import larqlpy.kernels.attention.decode as attention  # noqa: E402
from larqlpy.kernels import cpu  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def load_copy(path: Path, name: str = "attention_against"):
    """Another copy of a kernel module, loaded under its own name beside this one."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kernel_mode(copies: dict, shape: list[int], rows: list[int], kv: torch.dtype, calls: int) -> None:
    h, hkv, d = shape
    k, v = (torch.randn(hkv, max(rows) + 1, d).to(kv) for _ in range(2))
    q = torch.randn(1, h, d)
    print(f"heads {h} / {hkv}, D {d}, {kv} rows, {numba.get_num_threads()} thread(s), {calls} calls each")
    for n in rows:
        times = {name: [] for name in copies}
        for name, mod in copies.items():  # compiled and warm before timing
            mod.attend_rows(q, [mod.Span(k, v, 0, n)], 0.125)
        for _ in range(calls):
            for name, mod in copies.items():
                span = [mod.Span(k, v, 0, n)]
                t = time.perf_counter()
                mod.attend_rows(q, span, 0.125)
                times[name].append(time.perf_counter() - t)
        cells = [f"{name} {np.median(t) * 1e6:8.1f} µs (min {np.min(t) * 1e6:7.1f})" for name, t in times.items()]
        macs = 2 * h * n * d / np.min(times["this"]) / 1e9
        print(f"rows {n:6d}: " + " | ".join(cells) + f" | this: {macs:.2f} multiply-adds/ns")


def kernels_of(mod) -> tuple[dict, dict, dict]:
    """A copy's kernels as this checkout's attend_rows reads them, by head size (an older copy's one
    kernel of every size under each)."""
    if hasattr(mod, "ONE_CHUNK"):
        return mod.ROWS, mod.SERIAL, mod.ONE_CHUNK
    old = (mod._attend_rows, mod._attend_serial, mod._attend_chunk)
    return tuple(dict.fromkeys(attention.ONE_CHUNK, k) for k in old)


def swap(kernels) -> None:
    attention.ROWS, attention.SERIAL, attention.ONE_CHUNK = kernels


def step_mode(copies: dict, model: Path, weights: str, positions: int, steps: int) -> None:
    runner = Larqlpy(model, weights, "canonical/v1")
    m = runner.loaded.model
    ids = torch.randint(100, 20000, (positions,), generator=torch.Generator().manual_seed(0))
    kernels = {name: kernels_of(mod) for name, mod in copies.items()}
    runs = {}
    for name in copies:
        swap(kernels[name])
        state, logits = runner.prefill(ids)
        tok = m(logits[-1].argmax().reshape(1), state)[-1].argmax().reshape(1)  # compiles this copy
        runs[name] = [state, tok, []]
    for i in range(steps):
        for name in (list(copies) if i % 2 == 0 else list(copies)[::-1]):
            swap(kernels[name])
            run = runs[name]
            t = time.perf_counter()
            run[1] = m(run[1], run[0])[-1].argmax().reshape(1)
            run[2].append(time.perf_counter() - t)
    swap(kernels["this"])
    cells = [f"{name} {np.median(run[2]) * 1e3:.2f} ms" for name, run in runs.items()]
    print(f"{model.name} {weights}, a decode step after {positions} positions, median of {steps}: " + " | ".join(cells))
    if "against" in runs:
        print(f"speed-up {np.median(runs['against'][2]) / np.median(runs['this'][2]):.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, help="another copy of kernels/attention/decode.py to time beside this one")
    ap.add_argument("--shape", default="14,2,64", help="query heads, KV heads, head size")
    ap.add_argument("--rows", default="300,1100,4000")
    ap.add_argument("--kv", choices=DTYPES, default="f16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--step", type=Path, help="instead: whole decode steps of this model")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=80)
    a = ap.parse_args()
    if a.threads:
        numba.set_num_threads(a.threads)
    copies = {"this": attention}
    if a.against:
        copies["against"] = load_copy(a.against)
    print(f"CPU: {cpu_name()}, {numba.get_num_threads()} thread(s); kernel features (LLVM): {cpu.describe()}")
    if a.step:
        step_mode(copies, a.step, a.weights, a.positions, a.steps)
    else:
        kernel_mode(copies, [int(x) for x in a.shape.split(",")], [int(x) for x in a.rows.split(",")],
                    DTYPES[a.kv], a.calls)


if __name__ == "__main__":
    main()
