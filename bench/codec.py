"""codec/v1 speed, measured side by side in one run:

1. kernel throughput in GB/s of f32 rows: encode and decode with the numba kernels and the torch twin,
   beside a plain copy of the same bytes;
2. decode tokens/s of codec/v1 (attending on codes, and decoding into scratch) against window/v1
   after 4K and 8K positions on the 270M.

    python bench/codec.py --model models/gemma-3-270m [--contexts 4096,8192] [--steps 16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def best_time(fn, repeats: int = 5) -> float:
    """Median seconds of `fn` after one warm-up call."""
    from decode import median_time

    fn()
    return median_time(fn, repeats)


def kernels(rows: int = 65536, d: int = 256) -> None:
    from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec
    from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec

    x = torch.randn(rows, d)
    nbytes = x.numel() * 4
    copy = best_time(lambda: x.clone())
    print(f"kernels on {rows:,} rows x {d} (f32 {nbytes / 2**20:.0f} MiB), threads {torch.get_num_threads()}")
    print(f"  plain copy                      {nbytes / copy / 1e9:6.2f} GB/s")
    for bits in (4, 3):
        nb, tc = TurboQuantCodec(d, bits, torch.device("cpu")), TorchCodec(d, bits, torch.device("cpu"))
        enc = nb.encode(x)
        out = torch.empty_like(x)
        t_ne, t_nd = best_time(lambda: nb.encode(x)), best_time(lambda: nb.decode(enc, out=out))
        norms, codes = tc.encode(x)
        t_te, t_td = best_time(lambda: tc.encode(x), 3), best_time(lambda: tc.decode(norms, codes), 3)
        for name, t in ((f"numba encode {bits}-bit", t_ne), (f"numba decode {bits}-bit", t_nd),
                        (f"torch encode {bits}-bit", t_te), (f"torch decode {bits}-bit", t_td)):
            print(f"  {name:30}  {nbytes / t / 1e9:6.2f} GB/s  ({copy / t:.2f}x copy speed)")


def decode_speed(model_dir: Path, contexts: list[int], steps: int) -> None:
    from larqlpy.engines import new_state, parse_engine_spec
    from larqlpy.engines import preset_spec
    from larqlpy.engines.presets import RECOMMENDED
    from larqlpy.model.decoder import prefill

    from larqlpy.weights.loader import load

    loaded = load(model_dir, device="cpu")
    text = (ROOT / "larqlpy" / "data" / "long.txt").read_text()
    ids = loaded.tokenizer.encode(text * (1 + max(contexts) // 2500))
    specs = [("window/v1", parse_engine_spec(continuation="window/v1"), True),
             ("codec/v1 bits=4 (on codes)", parse_engine_spec(continuation="codec/v1", options=["bits=4"]), True),
             ("codec/v1 bits=4 (scratch)", parse_engine_spec(continuation="codec/v1", options=["bits=4"]), False),
             ("recommended (on codes)", preset_spec(RECOMMENDED), True)]
    print(f"decode after a long prefill, {steps} steps, {model_dir.name} ({loaded.weights} weights)")
    for n in contexts:
        results = {}
        for name, spec, fused in specs:
            state = new_state(spec, loaded.model.geometries(), loaded.device)
            prefill(loaded.model, state, ids[:n], 1024)
            for s in state.layers:
                if hasattr(s, "fused"):  # the store decides per step whether to attend on codes
                    s.fused = fused and s.fused
            tok = torch.tensor([ids[n]])
            loaded.model(tok, state)  # warm-up step
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = loaded.model(tok, state)[-1].argmax().reshape(1)
            results[name] = steps / (time.perf_counter() - t0)
            print(f"  {n:>6} positions  {name:28} {results[name]:6.2f} tok/s   resident KV "
                  f"{state.resident_bytes() / 2**20:8.2f} MiB")
        base = results["window/v1"]
        print(f"  {n:>6} positions  codec/codes vs window {results['codec/v1 bits=4 (on codes)'] / base:.2f}x, "
              f"codec/scratch vs window {results['codec/v1 bits=4 (scratch)'] / base:.2f}x, "
              f"recommended vs window {results['recommended (on codes)'] / base:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-kernels", action="store_true", help="only the decode lines")
    args = ap.parse_args()
    if not args.no_kernels:
        kernels()
    decode_speed(Path(args.model), [int(c) for c in args.contexts.split(",")], args.steps)


if __name__ == "__main__":
    main()
