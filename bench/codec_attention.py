"""codec/v1's decode kernel (kernels/kvcodec/tq_attend.py) alone: one sequence's call (`attend`) and a family's
(`attend_family`: B branches of one prompt), optionally beside another copy of that file (an older
commit's) loaded into the same process, the copies taking turns call by call so a noisy host slows
them alike.

    python bench/codec_attention.py --shape 14,2,64 --rows 1040 --branches 4
    git show HEAD~1:larqlpy/kernels/kvcodec/tq_attend.py > /tmp/old_tq_attend.py
    python bench/codec_attention.py --against /tmp/old_tq_attend.py

The rows are random codes laid out as a forked branch reads them: the prompt's shared piece, the
branch's own rows past it, a recent tier (a ring at 8 bits, wrapped), one sink, and a key
calibration with a turning mean. Each copy's family output is checked equal, bit for bit, to each
branch's own call before timing. Prints each copy's median and minimum µs a call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from attention import load_copy  # noqa: E402
from stream import cpu_name  # noqa: E402

from larqlpy.kernels.kvcodec import tq_attend, turboquant as tq  # noqa: E402

RING, SINKS, OWN = 16, 1, 40  # tier rows, sink rows, a branch's own main rows


class Layer:
    """One layer's codes for `branches` branches at n positions, and the two calls on them."""

    def __init__(self, shape: list[int], n: int, branches: int, bits: int, seed: int = 0):
        h, self.hkv, self.d = shape
        rng = np.random.default_rng(seed)
        self.n, self.nb, self.shared_rows = n, branches, n - RING - OWN
        self.books = tq.codebook(bits)[0], bits, tq.codebook(8)[0], 8

        def piece(rows, b, lead=()):
            return (rng.random(lead + (self.hkv, rows), dtype=np.float32) + 0.5,
                    rng.integers(0, 256, lead + (self.hkv, rows, self.d * b // 8), dtype=np.uint8))

        self.k, self.v = piece(self.shared_rows, bits), piece(self.shared_rows, bits)
        self.own_k, self.own_v = piece(OWN, bits, (branches,)), piece(OWN, bits, (branches,))
        self.tier_k, self.tier_v = piece(RING, 8, (branches,)), piece(RING, 8, (branches,))
        self.first = 5  # the ring's slot of its oldest row read: it wraps after RING - 5 rows
        d, hkv = self.d, self.hkv
        self.cal = (rng.random((hkv, d), dtype=np.float32) + 0.5, rng.standard_normal((hkv, d), dtype=np.float32),
                    rng.standard_normal((hkv, d), dtype=np.float32), rng.standard_normal((n, d), dtype=np.float32))
        self.sinks = tuple(rng.standard_normal((hkv, SINKS, d), dtype=np.float32) for _ in range(2))
        self.q = rng.standard_normal((branches, hkv, h // hkv, d), dtype=np.float32)
        self.signs, self.bounds = tq.signs(d), (n - RING, n - RING, n)
        self.scale = np.float32(d ** -0.5)

    def single(self, mod, b: int, out: np.ndarray) -> None:
        kbook, kbits, tbook, tbits = self.books
        run = RING - self.first

        def pieces(main, own, tier):
            return ((main[0], main[1], 0, self.shared_rows), (own[0][b], own[1][b], 0, OWN),
                    (tier[0][b], tier[1][b], self.first, run), (tier[0][b], tier[1][b], 0, RING - run))

        ka, kb, tka, tkb = pieces(self.k, self.own_k, self.tier_k)
        va, vb, tva, tvb = pieces(self.v, self.own_v, self.tier_v)
        mod.attend(self.q[b], self.cal, self.signs, (ka, kb, kbook, kbits, va, vb, kbook, kbits),
                   (tka, tkb, tbook, tbits, tva, tvb, tbook, tbits),
                   (np.zeros((self.hkv, 0, self.d), np.float32), *self.sinks), self.bounds, self.scale,
                   np.float32(0.0), out)

    def family(self, mod, out: np.ndarray) -> None:
        kbook, kbits, tbook, tbits = self.books
        shared = (*self.k, 0, self.shared_rows, *self.v, 0, self.shared_rows, kbook, kbits, kbook, kbits)
        tier = (*self.tier_k, *self.tier_v, tbook, tbits, tbook, tbits, self.first, RING - self.first)
        mod.attend_family(self.q, self.cal, self.signs, shared, (*self.own_k, *self.own_v), tier, self.sinks,
                          self.bounds, self.scale, np.float32(0.0), out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, help="another copy of kernels/kvcodec/tq_attend.py to time beside this one")
    ap.add_argument("--shape", default="14,2,64", help="query heads, KV heads, head size")
    ap.add_argument("--rows", type=int, default=1040)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    layer = Layer([int(x) for x in args.shape.split(",")], args.rows, args.branches, args.bits)
    copies = {"this": tq_attend} | ({"against": load_copy(args.against, "tq_attend_against")} if args.against else {})
    one, many = np.empty(layer.q.shape[1:], np.float32), np.empty(layer.q.shape, np.float32)
    for name, mod in copies.items():  # compiled and warm before timing
        layer.family(mod, many)
        for b in range(layer.nb):
            layer.single(mod, b, one)
            if not np.array_equal(one, many[b]):
                sys.exit(f"{name}: branch {b} of the family is not its own call's bits")
    times = {name: ([], []) for name in copies}
    for _ in range(args.calls):
        for name, mod in copies.items():
            t = time.perf_counter()
            layer.single(mod, 0, one)
            t1 = time.perf_counter()
            layer.family(mod, many)
            times[name][0].append(t1 - t)
            times[name][1].append(time.perf_counter() - t1)
    print(f"CPU: {cpu_name()}, {numba.get_num_threads()} threads; shape {args.shape}, {args.rows} rows, "
          f"{args.bits}-bit codes, {args.calls} calls each")
    print(f"| copy | one sequence µs (median, min) | family of {args.branches} µs (median, min) |\n|---|---|---|")
    for name, (a, f) in times.items():
        print(f"| {name} | {statistics.median(a) * 1e6:.0f}, {min(a) * 1e6:.0f} | "
              f"{statistics.median(f) * 1e6:.0f}, {min(f) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
