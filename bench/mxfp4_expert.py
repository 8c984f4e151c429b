"""One GPT-OSS-shaped MXFP4 expert matrix (gpt-oss-20b's gate|up: 5760 x 2880) held two ways: as the
file's 4-bit nibbles looked up in the "fp4" table with the exponent bytes as scales (what `native`
packs now), and as 5-bit codes kv + 16 with the exponents' float values as scales (what it packed
before: float16 where every one is, as a real file's exponents near a weight's are). Prints the bytes
held per weight and the process CPU seconds of one decode product (one activation row) on each
integer path this CPU has: CPU time, not wall, so a shared machine slows it less. Random blocks,
exponents 118..127 (weights of 2^-10 .. 12 * 2^-1). Asserts nothing.

    python bench/mxfp4_expert.py [--rows 5760] [--cols 2880] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from larqlpy.kernels import cpu
from larqlpy.kernels.weights.gguf_blocks import LAYOUTS, packed_width, tiled_arrays, unpack_tiled
from larqlpy.kernels.weights.packing import code_shape
from larqlpy.kernels.weights.qweight import TILE, PackedWeight
from larqlpy.kernels.weights.simd import fits


def packed(raw: np.ndarray, shape: tuple[int, int], width: tuple) -> PackedWeight:
    """The blocks unpacked into the tiled layout at `width` ((bits, base); a table's name, base 0)."""
    n, k = shape
    codes, scale, minimum, _, seen = tiled_arrays("MXFP4", n, k)
    if width[0] != packed_width("MXFP4")[0]:  # the old layout: 5-bit codes, zeroed high words
        codes = np.zeros(code_shape(codes.shape[0], k, width[0]), np.uint8)
    unpack_tiled(raw, "MXFP4", shape, np.arange(n), 0, codes, scale, minimum, seen, width)
    return PackedWeight.from_tiled(codes, shape, scale, None, LAYOUTS["MXFP4"][4] - width[1], width[0],
                                   int(seen[:, 0].min()), int(seen[:, 1].max()))


def cpu_seconds(w: PackedWeight, x: torch.Tensor, path: str, reps: int) -> float:
    """Process CPU seconds per product, the best of three runs of `reps`."""
    w.matmul(x, path)  # compiled and warm
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        for _ in range(reps):
            w.matmul(x, path)
        best = min(best, (time.process_time() - t) / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5760)
    p.add_argument("--cols", type=int, default=2880)
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    shape = (a.rows, a.cols)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (a.rows, a.cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(118, 128, raw.shape[:2])
    raw = raw.reshape(a.rows, -1)
    ways = {"fp4 table, exponent bytes": packed(raw, shape, packed_width("MXFP4")),
            "5-bit codes, float scales": packed(raw, shape, (5, 112))}
    x = torch.randn(1, a.cols)
    first = next(iter(ways.values()))
    for name, w in ways.items():
        assert torch.equal(w.rows(torch.arange(4)), first.rows(torch.arange(4)))  # the same values
        held = 8 * w.nbytes / (w.codes.shape[0] * TILE * a.cols)
        times = {path: cpu_seconds(w, x, path, a.reps) for path in cpu.runnable_paths()
                 if path != "float" and fits(path, w.width) and (path != "avx2" or w.highest <= 127)}
        print(f"{name}: {held:.3f} bits a weight ({w.nbytes / 1e6:.2f} MB), scales {w.scale.dtype}; " +
              ", ".join(f"{path} {1e3 * s:.3f} ms CPU" for path, s in times.items()))


if __name__ == "__main__":
    main()
