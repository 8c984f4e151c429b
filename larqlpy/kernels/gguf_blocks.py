"""A GGUF matrix's quantized blocks taken apart into integer codes, straight from the block bytes:
what `weights` native runs when it loads a .gguf file directly.

The result is convert/native.py's, code for code (tests/test_gguf_file.py holds them equal on random
blocks of every type and on the shipped files): codes u (out, in) uint8, one float32 scale (and
minimum) per group, the zero point and the code width of kernels/qweight.py, such that
scale * (u - zero) (+ minimum), rounded one operation at a time in float32, is gguf-py's dequantized
value. convert/native.py reads the codes by probing gguf-py's dequantizer (slow, and the reference);
these loops read the bits as ggml's block layouts lay them out, at a few hundred MB/s per core.

The float16 fields (d, dmin, m) are widened by numpy; numba unpacks the bits and multiplies the
K-quants' sub-block scales in, as gguf-py does: (d * sc) first.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# type name -> (block bytes, values per block, code bits, group, zero, affine)
LAYOUTS = {
    "Q8_0": (34, 32, 8, 32, 128, False), "Q5_0": (22, 32, 8, 32, 128, False), "Q4_0": (18, 32, 4, 32, 8, False),
    "Q4_1": (20, 32, 4, 32, 0, True), "Q5_1": (24, 32, 8, 32, 0, True),
    "Q4_K": (144, 256, 4, 32, 0, True), "Q5_K": (176, 256, 8, 32, 0, True), "Q6_K": (210, 256, 8, 16, 128, False),
}
KIND = {name: i for i, name in enumerate(LAYOUTS)}


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 (nb,)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0].astype(np.float32)


@njit(inline="always", cache=True)
def _scale_min_k4(s, b, j):  # pragma: no cover - jitted
    """Sub-block j's 6-bit scale and minimum of a Q4_K / Q5_K block (12 bytes at byte 4)."""
    if j < 4:
        return np.int32(s[b, 4 + j] & 63), np.int32(s[b, 8 + j] & 63)
    sc = np.int32((s[b, 8 + j] & 15) | ((s[b, j] >> 6) << 4))
    m = np.int32((s[b, 8 + j] >> 4) | ((s[b, 4 + j] >> 6) << 4))
    return sc, m


@njit(parallel=True, cache=True)
def _simple(blocks, kind, d, m, u, scale, minimum):  # pragma: no cover - jitted
    """The 32-value types: u (nb, 32), scale / minimum (nb,)."""
    for b in prange(blocks.shape[0]):
        scale[b] = d[b]
        if kind == 0:  # Q8_0: int8 q + 128
            for j in range(32):
                u[b, j] = blocks[b, 2 + j] ^ 128
        elif kind == 2 or kind == 3:  # Q4_0 (qs at 2), Q4_1 (m at 2, qs at 4)
            at = 2 if kind == 2 else 4
            for j in range(16):
                u[b, j] = blocks[b, at + j] & 15
                u[b, j + 16] = blocks[b, at + j] >> 4
        else:  # Q5_0 (qh at 2, qs at 6; q - 16 + 128), Q5_1 (m at 2, qh at 4, qs at 8; affine)
            at = 2 if kind == 1 else 4
            qh = np.uint32(blocks[b, at]) | (np.uint32(blocks[b, at + 1]) << 8) | \
                (np.uint32(blocks[b, at + 2]) << 16) | (np.uint32(blocks[b, at + 3]) << 24)
            shift = 112 if kind == 1 else 0
            for j in range(16):
                lo = (blocks[b, at + 4 + j] & 15) | (((qh >> j) & 1) << 4)
                hi = (blocks[b, at + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
                u[b, j] = lo + shift
                u[b, j + 16] = hi + shift
        if kind == 3 or kind == 4:
            minimum[b] = m[b]


@njit(parallel=True, cache=True)
def _k4_k5(blocks, five, d, dmin, u, scale, minimum):  # pragma: no cover - jitted
    """Q4_K / Q5_K: u (nb, 256), scale / minimum (nb, 8) per sub-block of 32."""
    qs = 48 if five else 16
    for b in prange(blocks.shape[0]):
        for c in range(4):  # 64 values: a low-nibble sub-block then a high-nibble one
            for half in range(2):
                j = 2 * c + half
                sc, mn = _scale_min_k4(blocks, b, j)
                scale[b, j] = d[b] * np.float32(sc)
                minimum[b, j] = -(dmin[b] * np.float32(mn))
                for v in range(32):
                    byte = np.int32(blocks[b, qs + 32 * c + v])
                    q = (byte >> 4) if half else (byte & 15)
                    if five:
                        q |= ((np.int32(blocks[b, 16 + v]) >> j) & 1) << 4
                    u[b, 32 * j + v] = q if sc > 0 else 0  # a scale of 0: the codes are undefined


@njit(parallel=True, cache=True)
def _q6_k(blocks, d, u, scale):  # pragma: no cover - jitted
    """Q6_K: u (nb, 256) = q + 128, scale (nb, 16) per sub-block of 16."""
    for b in prange(blocks.shape[0]):
        for s in range(16):
            sc = np.int32(np.int8(blocks[b, 192 + s]))
            scale[b, s] = d[b] * np.float32(sc)
        for n in range(2):
            for v in range(32):
                low = np.int32(blocks[b, 64 * n + v])
                high = np.int32(blocks[b, 64 * n + v + 32])
                h = np.int32(blocks[b, 128 + 32 * n + v])
                q = ((low & 15) | ((h & 3) << 4), (high & 15) | (((h >> 2) & 3) << 4),
                     (low >> 4) | (((h >> 4) & 3) << 4), (high >> 4) | (((h >> 6) & 3) << 4))
                for t in range(4):
                    p = 128 * n + 32 * t + v
                    keep = np.int8(blocks[b, 192 + p // 16]) != 0
                    u[b, p] = np.uint8(q[t] + 96) if keep else np.uint8(128)


def unpack(raw: np.ndarray, qtype: str, shape: tuple[int, int]):
    """(u (n, k) uint8, scale (n, groups) float32, minimum or None, zero, bits) of an (out, in) matrix
    whose rows are `raw`'s bytes (any shape with n * k / values-per-block blocks), or None for a type
    held as float."""
    if qtype not in LAYOUTS:
        return None
    size, per, bits, group, zero, affine = LAYOUTS[qtype]
    n, k = shape
    blocks = np.asarray(raw).reshape(-1, size)
    nb = blocks.shape[0]
    u = np.empty((nb, per), np.uint8)
    groups = per // group
    scale = np.empty((nb, groups), np.float32)
    minimum = np.empty((nb, groups), np.float32) if affine else np.empty((0, groups), np.float32)
    if qtype == "Q6_K":
        _q6_k(blocks, _half(blocks, 208), u, scale)
    elif per == 256:
        _k4_k5(blocks, qtype == "Q5_K", _half(blocks, 0), _half(blocks, 2), u, scale, minimum)
    else:
        m = _half(blocks, 2) if affine else np.zeros(0, np.float32)
        _simple(blocks, KIND[qtype], _half(blocks, 0), m, u, scale[:, 0], minimum[:, 0] if affine else m)
    return (u.reshape(n, k), scale.reshape(n, k // group), minimum.reshape(n, k // group) if affine else None,
            zero, bits)
