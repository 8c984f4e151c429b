"""The GGUF grid types taken apart into integer codes: IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S
and IQ1_M (gguf_blocks.py holds the rest and calls these by kind).

Each value is sign * grid value * a group scale (IQ1: (grid + delta) * dl), where the grid value is a
small integer from a table of 4 or 8 (gguf-py's `grid`, taken from gguf.quants, not copied here) and
the group scale d * f(sub-block scale) has at most 16 significant bits. So every product is exact in
float32, whatever order gguf-py rounds it in, and equals  scale * (u - zero)  with

  IQ3_S    (d * (1 + 2 s)) * g * sign        g odd 1..15, 32 a group, 4-bit s     codes g*sign + 128, 5 bits
  IQ3_XXS  (d * (0.5 + s) * 0.5) * g * sign  g 4..62 even, 32 a group             codes g/2*sign + 128 (6 bits),
                                                                                  scale d * (0.5 + s)
  IQ2_XXS  (d * (0.5 + s) * 0.25) * g * sign g in 8, 25, 43, 32 a group           codes g*sign + 128, 8 bits
  IQ2_XS   the same, 16 a group, 512-entry grid; IQ2_S: 1024 entries, signs as bits
  IQ1_S    (d * (2 s + 1)) * (g + delta)     g in -1, 0, 1, delta +-1/8, 32 a group   codes 8 g +- 1 + 128
  IQ1_M    the same, 16 a group, delta per 8, d spread over the scales' high nibbles  (5; IQ1_M 6), scale dl / 8

IQ3_S's scale d * (1 + 2 s) is two-level as the K-quants' (int8 1 + 2 s beside the block's float16 d:
gguf_blocks.TWO_LEVEL); the others' scales carry a power of two the kernels' d * sc has no place for,
so they are held as float32. Every sign is in the codes, so a zero keeps gguf-py's sign too.
"""

from __future__ import annotations

import numpy as np
from gguf import quants
from numba import njit

from larqlpy.kernels import jitcache
from larqlpy.kernels.weights import qdot
from larqlpy.kernels.weights.qdot import half_bits

FIRST = 13  # gguf_blocks.KIND of IQ3_S; IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M follow


def _grid(cls) -> np.ndarray:
    """gguf-py's grid of a type as int8 (entries, 4 or 8)."""
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.int8)


G3S, G3XXS = _grid(quants.IQ3_S), _grid(quants.IQ3_XXS) // 2
G2XXS, G2XS, G2S, G1 = _grid(quants.IQ2_XXS), _grid(quants.IQ2_XS), _grid(quants.IQ2_S), _grid(quants.IQ1_S)
KSIGNS = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).copy()  # 7 sign bits -> 8 (even parity)


@njit(inline="always", cache=True)
def _word(row, at):  # pragma: no cover - jitted
    return np.int64(row[at]) | (np.int64(row[at + 1]) << 8)


@njit(inline="always", cache=True)
def _long(row, at):  # pragma: no cover - jitted
    return _word(row, at) | (_word(row, at + 2) << 16)


@njit(inline="always", cache=True)
def _put(grid, idx, signs, buf, to, n):  # pragma: no cover - jitted
    """n values of grid entry idx, negated where bit j of signs is set, + 128 into buf at `to`."""
    for j in range(n):
        v = np.int32(grid[idx, j])
        buf[to + j] = np.uint8(128 + (-v if (signs >> j) & 1 else v))


@njit(inline="always", cache=True)
def _ones(idx, delta, buf, to):  # pragma: no cover - jitted
    """IQ1's 8 values of grid entry idx: 8 g + delta (+-1), + 128."""
    for j in range(8):
        buf[to + j] = np.uint8(128 + 8 * np.int32(G1[idx, j]) + delta)


@njit(inline="always", cache=True)
def _nibble(row, at, j):  # pragma: no cover - jitted
    return (np.int32(row[at + j // 2]) >> (4 * (j % 2))) & 15


@njit(inline="always", cache=True)
def _decode_iq3(row, at, kind, buf, sc):  # pragma: no cover - jitted
    d = half_bits(_word(row, at))
    if kind == FIRST:  # IQ3_S: qs at 2, qh at 66, sign bits at 74, 4-bit scales at 106
        for j in range(8):
            sc[j] = d * np.float32(1 + 2 * _nibble(row, at + 106, j))
        for i in range(64):
            idx = np.int32(row[at + 2 + i]) | (((np.int32(row[at + 66 + i // 8]) >> (i % 8)) & 1) << 8)
            _put(G3S, idx, np.int32(row[at + 74 + i // 2]) >> (4 * (i % 2)), buf, 4 * i, 4)
    else:  # IQ3_XXS: grid indices at 2, a uint32 a group at 66 (4 x 7 sign bits, scale in the top 4)
        for g in range(8):
            a = _long(row, at + 66 + 4 * g)
            sc[g] = d * np.float32(0.5 + np.float32(a >> 28))
            for i in range(8):
                _put(G3XXS, np.int32(row[at + 2 + 8 * g + i]), KSIGNS[(a >> (7 * (i // 2))) & 127] >> (4 * (i % 2)),
                     buf, 32 * g + 4 * i, 4)


@njit(inline="always", cache=True)
def _decode_iq2(row, at, kind, buf, sc):  # pragma: no cover - jitted
    d = half_bits(_word(row, at))
    if kind == FIRST + 2:  # IQ2_XXS: per group 4 grid index bytes, then a uint32 of signs and scale
        for g in range(8):
            a = _long(row, at + 6 + 8 * g)
            sc[g] = d * np.float32(0.5 + np.float32(a >> 28)) * np.float32(0.25)
            for i in range(4):
                _put(G2XXS, np.int32(row[at + 2 + 8 * g + i]), KSIGNS[(a >> (7 * i)) & 127], buf, 32 * g + 8 * i, 8)
        return
    for j in range(16):  # IQ2_XS (scales at 66), IQ2_S (at 74): a 4-bit scale a 16
        sc[j] = d * np.float32(0.5 + np.float32(_nibble(row, at + (66 if kind == FIRST + 3 else 74), j))) * \
            np.float32(0.25)
    for i in range(32):
        if kind == FIRST + 3:  # IQ2_XS: uint16s of a 9-bit index and 7 sign bits
            q = _word(row, at + 2 + 2 * i)
            _put(G2XS, q & 511, KSIGNS[q >> 9], buf, 8 * i, 8)
        else:  # IQ2_S: index bytes at 2, sign bytes at 34, the index's 2 high bits at 66
            idx = np.int32(row[at + 2 + i]) | (((np.int32(row[at + 66 + i // 4]) >> (2 * (i % 4))) & 3) << 8)
            _put(G2S, idx, np.int32(row[at + 34 + i]), buf, 8 * i, 8)


@njit(inline="always", cache=True)
def _decode_iq1(row, at, kind, buf, sc):  # pragma: no cover - jitted
    if kind == FIRST + 5:  # IQ1_S: d, indices' low bytes at 2, a uint16 a group at 34
        d = half_bits(_word(row, at))
        for g in range(8):
            h = np.int32(_word(row, at + 34 + 2 * g))
            sc[g] = d * np.float32(2 * ((h >> 12) & 7) + 1) * np.float32(0.125)
            for i in range(4):
                _ones(np.int32(row[at + 2 + 4 * g + i]) | (((h >> (3 * i)) & 7) << 8), 1 - 2 * (h >> 15), buf,
                      32 * g + 8 * i)
        return
    s = (_word(row, at + 48), _word(row, at + 50), _word(row, at + 52), _word(row, at + 54))  # IQ1_M
    d = half_bits((s[0] >> 12) | ((s[1] >> 8) & 0xF0) | ((s[2] >> 4) & 0xF00) | (s[3] & 0xF000))
    for j in range(16):
        sc[j] = d * np.float32(2 * ((s[j // 4] >> (3 * (j % 4))) & 7) + 1) * np.float32(0.125)
    for i in range(32):  # a nibble of qh (at 32) an index: its 3 high bits, and delta's sign at bit 3
        nib = _nibble(row, at + 32, i)
        _ones(np.int32(row[at + i]) | ((nib & 7) << 8), 1 - 2 * (nib >> 3), buf, 8 * i)


@njit(inline="always", cache=True)
def decode(row, at, kind, buf, sc, mn):  # pragma: no cover - jitted
    """The block at byte `at` of `row` (a kind FIRST on): codes into buf, group scales as float32 into
    sc (mn unused: no type here has a minimum)."""
    if kind <= FIRST + 1:
        _decode_iq3(row, at, kind, buf, sc)
    elif kind <= FIRST + 4:
        _decode_iq2(row, at, kind, buf, sc)
    else:
        _decode_iq1(row, at, kind, buf, sc)


@njit(inline="always", cache=True)
def outer(row, at, kind, sc, mn):  # pragma: no cover - jitted
    """IQ3_S's integer sub-block scales 1 + 2 s into sc, and its float16 d as bits."""
    for j in range(8):
        sc[j] = np.float32(1 + 2 * _nibble(row, at + 106, j))
    return np.uint16(_word(row, at)), np.uint16(0)


jitcache.tie(globals(), qdot)  # inlines qdot.py's half_bits
