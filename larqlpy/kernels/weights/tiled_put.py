"""A GGUF block's decoded codes written into the tiled layout the integer kernels read (qweight.py,
codebytes.py), eight codes at a time as one 64-bit integer: gguf_blocks' `_tiled` calls it per block."""

from __future__ import annotations

import numpy as np
from numba import njit

from larqlpy.kernels.weights.simd import ROWS as TILE

_BYTES = np.uint64(0x0101010101010101)
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", cache=True)
def put(codes, t, o, slot, words, eights, per, bits, base):  # pragma: no cover - jitted
    """One block's codes (the decoder's buffer as `words` uint32 and `eights` uint64, less base) into
    row `slot` of tile t from unit o on: a word per 4 (8 bits), 8 (nibbles) or 16 (crumbs) inputs, and
    at 3, 5 and 6 bits the high bits ORed into the row's high word (simd.high_at). Eight
    codes at a time as one integer: every code is at least `base`, so subtracting it from each byte
    borrows nowhere."""
    if bits == 8:
        for w in range(per // 4):
            codes[t, o + w, slot] = words[w]
        return
    if bits < 4:
        _put_crumbs(codes, t, o, slot, eights, per, bits, np.uint64(base) * _BYTES)
        return
    less = np.uint64(base) * _BYTES
    for w in range(per // 8):  # inputs 8o+i in the low nibbles, 8o+4+i in the high
        x = eights[w] - less
        nib = x & np.uint64(0x0F0F0F0F0F0F0F0F)
        codes[t, o + w, slot] = np.uint32((nib & np.uint64(0xFFFFFFFF)) | ((nib >> np.uint64(32)) << np.uint64(4)))
        if bits > 4:  # 5, 6 bits: inputs 8o+i's high bits at field f, 8o+4+i's at f + 1 (simd.high_at)
            p, ow = bits - 4, o + w
            per, slots = 4 // p, TILE // (4 // p)
            f = 2 * (ow % per)
            high = (x >> np.uint64(4)) & (_BYTES * np.uint64((1 << p) - 1))
            word = ((high & np.uint64(0xFFFFFFFF)) << np.uint64(f * p)) | \
                ((high >> np.uint64(32)) << np.uint64((f + 1) * p))
            codes[t, ow // per * per + slot // slots, TILE + slot % slots] |= np.uint32(word)


@njit(inline="always", cache=True)
def _put_crumbs(codes, t, o, slot, eights, per, bits, less):  # pragma: no cover - jitted
    """`put` at 2 and 3 bits: inputs 16o + 4s + i at bits 2s of byte i; at 3 bits each code's third bit
    into field 4 (o mod 2) + s of byte i of the row's high word (a word per 2 units, 32 rows an area)."""
    crumbs, one = np.uint64(0x0303030303030303), np.uint64(1)
    for w in range(per // 16):
        x0, x1 = eights[2 * w] - less, eights[2 * w + 1] - less  # parts 0, 1 and 2, 3: 4 bytes each
        c0, c1 = x0 & crumbs, x1 & crumbs
        codes[t, o + w, slot] = np.uint32((c0 & _LOW32) | ((c0 >> np.uint64(32)) << np.uint64(2)) |
                                          ((c1 & _LOW32) << np.uint64(4)) | ((c1 >> np.uint64(32)) << np.uint64(6)))
        if bits == 3:
            ow = o + w
            f = np.uint64(4 * (ow % 2))
            h0, h1 = (x0 >> np.uint64(2)) & _BYTES, (x1 >> np.uint64(2)) & _BYTES
            word = ((h0 & _LOW32) << f) | ((h0 >> np.uint64(32)) << (f + one)) | \
                ((h1 & _LOW32) << (f + np.uint64(2))) | ((h1 >> np.uint64(32)) << (f + np.uint64(3)))
            codes[t, ow // 2 * 2 + slot // 32, TILE + slot % 32] |= np.uint32(word)
