"""The GGUF block types below 4.5 bits and the table-valued ones, taken apart into integer codes: Q2_K,
Q3_K, IQ4_NL, IQ4_XS and MXFP4 (gguf_blocks.py holds the rest and calls these by kind).

Every one is an integer times a group scale (plus a minimum for Q2_K), so each becomes codes u, a
scale (and minimum) per group and a zero point, such that scale * (u - zero) (+ minimum), one float32
operation at a time, is gguf-py's dequantized value (tests/test_gguf_quants.py, bit for bit):

  Q2_K     (d * sc) * q - dmin * m     q 2-bit, group 16, 4-bit sc and m   codes q, affine (packed at 2 bits)
  Q3_K     (d * (sc - 32)) * q         q in -4..3, group 16, 6-bit sc      codes q + 4, zero 4 (packed at 3 bits)
  IQ4_NL   d * kv[q]                   kv: int8 table of 16, group 32      codes kv + 128, zero 128
  IQ4_XS   (d * (ls - 32)) * kv[q]     group 32, 6-bit ls per 32           codes kv + 128, zero 128
  MXFP4    2^(e - 128) * kv[q]         kv: e2m1 doubled, e an 8-bit exponent  codes kv + 128, zero 128

x - y is x + (-y) in IEEE arithmetic and (-dmin) * m is -(dmin * m), so Q2_K's minimum -(dmin * m)
added gives gguf-py's subtraction exactly. The K-quants and IQ4_XS keep their integer sub-block
scales two-level (gguf_blocks.TWO_LEVEL: int8 beside each block's float16 d and -dmin). IQ4_NL, IQ4_XS
and MXFP4 run as the file's nibbles, indices into their table (gguf_blocks.TABLED); MXFP4 keeps its
exponent byte e as its scale (gguf_blocks.EXPONENT: `outer` gives it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from larqlpy.kernels import jitcache
from larqlpy.kernels.weights import codebytes, qdot
from larqlpy.kernels.weights.codebytes import E8M0, TABLES
from larqlpy.kernels.weights.qdot import half_bits

FIRST = 8  # gguf_blocks.KIND of Q2_K; Q3_K, IQ4_NL, IQ4_XS, MXFP4 follow in that order
# IQ4_NL's and IQ4_XS's non-linear grid and MXFP4's doubled e2m1 values, each + 128: the codes
IQ4 = TABLES["iq4"]  # the kernels look it up from the file's nibbles (gguf_blocks.TABLED)
FP4 = TABLES["fp4"]


@njit(inline="always", cache=True)
def _word(row, at):  # pragma: no cover - jitted
    return np.int32(row[at]) | (np.int32(row[at + 1]) << 8)


@njit(inline="always", cache=True)
def _q3_scale(row, at, j):  # pragma: no cover - jitted
    """Q3_K sub-block j's 6-bit scale less 32 (scales at byte 96: low nibbles in 96..103, high pairs in
    104..107)."""
    low = (np.int32(row[at + 96 + j % 8]) >> (4 * (j // 8))) & 15
    high = (np.int32(row[at + 104 + j % 4]) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@njit(inline="always", cache=True)
def _xs_scale(row, at, j):  # pragma: no cover - jitted
    """IQ4_XS sub-block j's 6-bit scale less 32 (high pairs in the uint16 at 2, low nibbles at 4)."""
    low = (np.int32(row[at + 4 + j // 2]) >> (4 * (j % 2))) & 15
    return (low | (((_word(row, at + 2) >> (2 * j)) & 3) << 4)) - 32


@njit(inline="always", cache=True)
def _nibbles(row, q, table, buf, to):  # pragma: no cover - jitted
    """16 bytes at q as 32 table values: low nibbles first, then high (IQ4_NL, IQ4_XS, MXFP4)."""
    for j in range(16):
        b = np.int32(row[q + j])
        buf[to + j] = table[b & 15]
        buf[to + j + 16] = table[b >> 4]


@njit(inline="always", cache=True)
def _crumbs(row, q, buf):  # pragma: no cover - jitted
    """Q2_K's and Q3_K's 2-bit fields: byte 32 n + l of q holds values 128 n + 32 s + l at bits 2 s."""
    for n in range(2):
        for s in range(4):
            for v in range(32):
                buf[128 * n + 32 * s + v] = (np.int32(row[q + 32 * n + v]) >> (2 * s)) & 3


@njit(inline="always", cache=True)
def decode(row, at, kind, buf, sc, mn):  # pragma: no cover - jitted
    """The block at byte `at` of `row` (a kind FIRST on): codes into buf, group scales and minimums
    as float32 into sc / mn, each as gguf-py rounds them."""
    if kind == FIRST:  # Q2_K: 16 scale bytes (sc low nibble, m high), qs at 16, d at 80, dmin at 82
        d, dmin = half_bits(_word(row, at + 80)), half_bits(_word(row, at + 82))
        for j in range(16):
            b = np.int32(row[at + j])
            sc[j] = d * np.float32(b & 15)
            mn[j] = -(dmin * np.float32(b >> 4))
        _crumbs(row, at + 16, buf)
    elif kind == FIRST + 1:  # Q3_K: hmask at 0, qs at 32, scales at 96, d at 108; q = low - 4 (1 - high)
        d = half_bits(_word(row, at + 108))
        for j in range(16):
            sc[j] = d * np.float32(_q3_scale(row, at, j))
        _crumbs(row, at + 32, buf)
        for p in range(256):  # the high bit of value 128 n + 32 s + l: bit 4 n + s of hmask byte l
            buf[p] += ((np.int32(row[at + p % 32]) >> (p // 32)) & 1) << 2
    elif kind == FIRST + 2:  # IQ4_NL: d at 0, 16 bytes of nibbles at 2
        sc[0] = half_bits(_word(row, at))
        _nibbles(row, at + 2, IQ4, buf, 0)
    elif kind == FIRST + 3:  # IQ4_XS: d at 0, scales at 2..7, 8 sub-blocks of 16 bytes at 8
        d = half_bits(_word(row, at))
        for j in range(8):
            sc[j] = d * np.float32(_xs_scale(row, at, j))
            _nibbles(row, at + 8 + 16 * j, IQ4, buf, 32 * j)
    else:  # MXFP4: exponent byte at 0, nibbles at 1
        sc[0] = E8M0[row[at]]
        _nibbles(row, at + 1, FP4, buf, 0)


@njit(inline="always", cache=True)
def outer(row, at, kind, sc, mn):  # pragma: no cover - jitted
    """A two-level block's (Q2_K, Q3_K, IQ4_XS) integer sub-block scales (and minimums) into sc / mn,
    and its float16 d and dmin as bits, dmin's sign flipped (a minimum is -(dmin * m)); MXFP4's
    exponent byte into sc[0] (its scale as held: no d)."""
    if kind == FIRST + 4:
        sc[0] = np.float32(row[at])
        return np.uint16(0), np.uint16(0)
    if kind == FIRST:
        for j in range(16):
            b = np.int32(row[at + j])
            sc[j], mn[j] = np.float32(b & 15), np.float32(b >> 4)
        return np.uint16(_word(row, at + 80)), np.uint16(_word(row, at + 82) ^ 0x8000)
    if kind == FIRST + 1:
        for j in range(16):
            sc[j] = np.float32(_q3_scale(row, at, j))
        return np.uint16(_word(row, at + 108)), np.uint16(0)
    for j in range(8):  # IQ4_XS
        sc[j] = np.float32(_xs_scale(row, at, j))
    return np.uint16(_word(row, at)), np.uint16(0)


jitcache.tie(globals(), qdot, codebytes)  # inlines qdot.py's half_bits; holds codebytes' tables
