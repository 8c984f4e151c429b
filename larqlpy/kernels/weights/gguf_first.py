"""The GGUF block types before gguf_lowbit's taken apart into integer codes: Q8_0, Q5_0, Q4_0, Q4_1,
Q5_1 and the K-quants Q4_K, Q5_K, Q6_K (gguf_blocks.py's layouts and kernels call these by kind).

A family of decoders to itself, as gguf_lowbit.py and gguf_grid.py are: gguf_blocks makes one
repacking kernel per family, so a file compiles only the decoders of the types it holds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from larqlpy.kernels import jitcache
from larqlpy.kernels.weights import qdot
from larqlpy.kernels.weights.qdot import half_bits

FIRST = 0  # gguf_blocks.KIND of Q8_0; Q5_0, Q4_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K follow in that order


@njit(inline="always", cache=True)
def _scale_min_k4(s, at, j):  # pragma: no cover - jitted
    """Sub-block j's 6-bit scale and minimum of a Q4_K / Q5_K block at byte `at` (12 bytes at at + 4)."""
    if j < 4:
        return np.int32(s[at + 4 + j] & 63), np.int32(s[at + 8 + j] & 63)
    sc = np.int32((s[at + 8 + j] & 15) | ((s[at + j] >> 6) << 4))
    m = np.int32((s[at + 8 + j] >> 4) | ((s[at + 4 + j] >> 6) << 4))
    return sc, m


@njit(inline="always", cache=True)
def _half_at(row, at):  # pragma: no cover - jitted
    return half_bits(np.int32(row[at]) | (np.int32(row[at + 1]) << 8))


@njit(inline="always", cache=True)
def outer(row, at, kind, sc, mn):  # pragma: no cover - jitted
    """A K-quant block's (Q4_K, Q5_K, Q6_K) sub-block scales (and minimums) as the file's integers into
    sc / mn, and its float16 d and dmin as bits, dmin's sign flipped (a minimum is -(dmin * m))."""
    if kind == 7:  # Q6_K: signed 8-bit scales, d at 208
        for j in range(16):
            sc[j] = np.float32(np.int8(row[at + 192 + j]))
        return np.uint16(np.int32(row[at + 208]) | (np.int32(row[at + 209]) << 8)), np.uint16(0)
    for j in range(8):
        s, m = _scale_min_k4(row, at, j)
        sc[j], mn[j] = np.float32(s), np.float32(m)
    d = np.int32(row[at]) | (np.int32(row[at + 1]) << 8)
    return np.uint16(d), np.uint16((np.int32(row[at + 2]) | (np.int32(row[at + 3]) << 8)) ^ 0x8000)


@njit(inline="always", cache=True)
def decode(row, at, kind, buf, sc, mn):  # pragma: no cover - jitted
    """The block at byte `at` of `row` (a kind below gguf_lowbit.FIRST): codes into buf, group scales
    and minimums as float32 into sc / mn, each as gguf-py rounds them."""
    d = _half_at(row, at + 208 if kind == 7 else at)
    d2 = _half_at(row, at + 2)  # m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K); unused by the others
    if kind == 0:  # Q8_0: int8 q + 128
        for j in range(32):
            buf[j] = row[at + 2 + j] ^ 128
        sc[0] = d
    elif kind == 2 or kind == 3:  # Q4_0 (qs at 2), Q4_1 (m at 2, qs at 4)
        q = at + (2 if kind == 2 else 4)
        for j in range(16):
            buf[j] = row[q + j] & 15
            buf[j + 16] = row[q + j] >> 4
        sc[0], mn[0] = d, d2
    elif kind == 1 or kind == 4:  # Q5_0 (qh at 2, qs at 6; q - 16 + 128), Q5_1 (m at 2, qh at 4, qs at 8)
        h = at + (2 if kind == 1 else 4)
        qh = np.uint32(row[h]) | (np.uint32(row[h + 1]) << 8) | (np.uint32(row[h + 2]) << 16) | \
            (np.uint32(row[h + 3]) << 24)
        shift = 112 if kind == 1 else 0
        for j in range(16):
            b = np.int32(row[h + 4 + j])
            buf[j] = (b & 15) + (((qh >> j) & 1) << 4) + shift
            buf[j + 16] = (b >> 4) + (((qh >> (j + 16)) & 1) << 4) + shift
        sc[0], mn[0] = d, d2
    elif kind == 5 or kind == 6:  # Q4_K / Q5_K: 8 sub-blocks of 32, low nibbles then high per 64
        qs = at + (48 if kind == 6 else 16)
        for j in range(8):
            s, m = _scale_min_k4(row, at, j)
            sc[j] = d * np.float32(s)
            mn[j] = -(d2 * np.float32(m))
            c, half = j // 2, j % 2
            for v in range(32):
                b = np.int32(row[qs + 32 * c + v])
                q = (b >> 4) if half else (b & 15)
                if kind == 6:
                    q |= ((np.int32(row[at + 16 + v]) >> j) & 1) << 4
                buf[32 * j + v] = q if s > 0 else 0  # a scale of 0: the codes are undefined
    else:  # Q6_K: q + 128 in 16 sub-blocks of 16
        for j in range(16):
            sc[j] = d * np.float32(np.int32(np.int8(row[at + 192 + j])))
        for n in range(2):
            for v in range(32):
                low = np.int32(row[at + 64 * n + v])
                high = np.int32(row[at + 64 * n + v + 32])
                h = np.int32(row[at + 128 + 32 * n + v])
                q = ((low & 15) | ((h & 3) << 4), (high & 15) | (((h >> 2) & 3) << 4),
                     (low >> 4) | (((h >> 4) & 3) << 4), (high >> 4) | (((h >> 6) & 3) << 4))
                for t in range(4):
                    p = 128 * n + 32 * t + v
                    buf[p] = np.uint8(q[t] + 96) if row[at + 192 + p // 16] != 0 else np.uint8(128)

jitcache.tie(globals(), qdot)  # inlines qdot.py's half_bits
