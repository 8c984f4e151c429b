"""Decode speed of the GGUF block types larqlpy runs at their own codes, against llama.cpp on the same
file: a model requantized by llama.cpp's own quantizer (llama_model_quantize, allow_requantize) to each
ftype, then larqlpy `native` and llama.cpp (llama-cpp-python, 2 threads) decoding greedily after a
short prompt, the two taking turns within every repeat, medians. Beside each: the file's types (most
bytes first), weight bytes a token reads (an untied embedding left out, for both), the matrices larqlpy
still reads as float32 (a type without codes), and how many of llama.cpp's 24 greedy ids are larqlpy's
top id when fed to it (tests/test_gguf_quants.py's measure). Asserts nothing.

    python bench/gguf_quants.py [--source FILE.gguf] [--ftypes Q3_K_M,Q2_K,IQ4_XS,IQ4_NL] [--dir DIR]
                                [--repeats 3] [--decode 32]

The default source is make bench-setup's Qwen2.5-Coder-1.5B Q4_K_M; requantized files are kept in
--dir (default .bench/gguf_quants/) and reused.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from decode import SHORT, Larqlpy, LlamaCpp  # noqa: E402
from stream import cpu_name  # noqa: E402

SOURCE = ROOT / "models" / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def requantize(src: Path, dst: Path, ftype: str) -> Path:
    """llama.cpp's quantizer, once: a file already at `dst` is reused."""
    import llama_cpp

    if not dst.is_file():
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), True, 2
        part = dst.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(p)) != 0:
            raise SystemExit(f"llama.cpp could not quantize {src} to {ftype}")
        part.rename(dst)
    return dst


def follows(ours: Larqlpy, cpp: LlamaCpp, ids: list[int], n: int = 24) -> int:
    """Of llama.cpp's n greedy ids, how many are larqlpy's top id when the same ids are fed to it."""
    from larqlpy.model.decoder import prefill

    cpp.prefill(ids)
    want = []
    for _ in range(n):
        want.append(int(np.argmax(cpp.last_logits())))
        cpp.llm.eval(want[-1:])
    state = ours.provider.new_state(ours.loaded.model.geometries(), ours.loaded.device)
    logits = prefill(ours.loaded.model, state, ids + want[:-1], 512, all_logits=True)[len(ids) - 1:]
    return int((logits.argmax(-1) == torch.tensor(want)).sum())


def measure(path: Path, repeats: int, decode: int) -> dict:
    from larqlpy.weights.gguf_file import GGUFFile

    ours, cpp = Larqlpy(path, "native", "canonical/v1"), LlamaCpp(path, 512)
    ids = ours.loaded.tokenizer.encode(SHORT)
    for r in (ours, cpp):  # warm-up: JIT, caches, page faults
        r.decode(ids, 4)
    rates = {"ours": [], "cpp": []}
    for i in range(repeats):  # taking turns, the order alternating: a slow spell lands on both
        for key, r in (("ours", ours), ("cpp", cpp)) if i % 2 == 0 else (("cpp", cpp), ("ours", ours)):
            rates[key].append(decode / r.decode(ids, decode))
    fb = ours.loaded.float_fallback
    sizes: dict[str, int] = {}
    for qtype, _, _, nbytes in GGUFFile(path).tensors.values():
        sizes[qtype] = sizes.get(qtype, 0) + nbytes
    types = "/".join(sorted((k for k in sizes if k != "F32"), key=lambda k: -sizes[k]))  # most bytes first
    row = {"types": types, "ours_mb": ours.bytes_per_token / 1e6,
           "cpp_mb": cpp.bytes_per_token / 1e6, "ours": statistics.median(rates["ours"]),
           "cpp": statistics.median(rates["cpp"]), "fallback": fb["text"] if fb else "none",
           "follows": follows(ours, cpp, ids)}
    del ours, cpp
    gc.collect()
    return row


def main() -> None:
    from larqlpy.kernels import cpu

    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--ftypes", default="Q3_K_M,Q2_K,IQ4_XS,IQ4_NL")
    ap.add_argument("--dir", type=Path, default=ROOT / ".bench" / "gguf_quants")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for ftype in args.ftypes.split(","):
        path = requantize(args.source, args.dir / f"{args.source.stem}-{ftype}.gguf", ftype)
        rows[ftype] = measure(path, args.repeats, args.decode)
        print(ftype, rows[ftype], flush=True)
    print(f"\nCPU: {cpu_name()}, 2 threads; kernel features (LLVM): {cpu.describe()}")
    print(f"{args.source.name} requantized by llama.cpp; decode of {args.decode} tokens after a short prompt, "
          f"median of {args.repeats}, the runners taking turns")
    print("| ftype | the file's types | MB a token: larqlpy / llama.cpp | larqlpy tok/s | llama.cpp tok/s | "
          "larqlpy / llama.cpp | llama.cpp's 24 greedy ids larqlpy's top | read as float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for ftype, r in rows.items():
        print(f"| {ftype} | {r['types']} | {r['ours_mb']:.0f} / {r['cpp_mb']:.0f} | {r['ours']:.1f} | {r['cpp']:.1f} | "
              f"{r['ours'] / r['cpp']:.2f}x | {r['follows']} / 24 | {r['fallback']} |")


if __name__ == "__main__":
    main()
