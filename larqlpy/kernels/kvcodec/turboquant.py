"""TurboQuant codec for one head vector x of length d (a power of two), CPU kernels in numba.

encode: norm = ||x|| (f32, summed in f64); u = x * (1 / norm); z = H(s * u), where s is a fixed +-1 sign
    diagonal and H the unnormalised Walsh-Hadamard butterfly -- so z = sqrt(d) * (orthonormal
    rotation of u) and each coordinate is close to N(0, 1); each z_i becomes the index of its
    Lloyd-Max cell (boundaries at the midpoints between centroids); indices are packed eight at a
    time into `bits` bytes, little-endian (4 bits: two per byte, low nibble first; 8 bits: one per
    byte; 2, 3, 5, 6 bits: eight per 2, 3, 5, 6 bytes).
decode: z' = centroids[index]; x' = s * H(z') * (norm / d)  (the inverse rotation, times norm/sqrt(d)
    for each of the two sqrt(d) factors).

Attending on codes without decoding (tq_attend.py): with q_r = H(s * q), q . x' = norm/d * (q_r . z'),
and sum_j p_j x'_j = s * H(sum_j p_j norm_j/d z'_j): rotate the query once per head, score against
centroid values, accumulate values in the rotated domain, rotate back once.

The torch twin (`turboquant_torch.py`) performs the same operations in the same order.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.kvcodec.codebooks import CENTROIDS

SIGN_SEED = 0x7475726271  # "turbq"


@functools.cache  # every layer's codecs, made again for each request's state, share them (never written)
def signs(d: int) -> np.ndarray:
    """The fixed +-1 diagonal of the randomized Hadamard transform for dimension d."""
    rng = np.random.default_rng(SIGN_SEED + d)
    return (rng.integers(0, 2, size=d) * 2 - 1).astype(np.float32)


@functools.cache
def codebook(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, boundaries) in float32; boundaries are computed in float64 and rounded once."""
    c = np.asarray(CENTROIDS[bits], dtype=np.float64)
    return c.astype(np.float32), ((c[1:] + c[:-1]) / 2).astype(np.float32)


@njit(cache=True, error_model="numpy", inline="always")
def fwht(v):  # pragma: no cover - jitted
    d = v.shape[0]
    for i in range(0, d, 4):  # stages h=1 and h=2 fused: the same adds in the same order, in registers
        a0 = v[i] + v[i + 1]
        a1 = v[i] - v[i + 1]
        a2 = v[i + 2] + v[i + 3]
        a3 = v[i + 2] - v[i + 3]
        v[i] = a0 + a2
        v[i + 1] = a1 + a3
        v[i + 2] = a0 - a2
        v[i + 3] = a1 - a3
    h = 4
    while h < d:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                a = v[j]
                b = v[j + h]
                v[j] = a + b
                v[j + h] = a - b
        h *= 2


@njit(cache=True, error_model="numpy", inline="always")
def _pack(idx, out, bits):  # pragma: no cover - jitted
    d = idx.shape[0]
    if bits == 4:
        for i in range(d // 2):
            out[i] = np.uint8(idx[2 * i] | (idx[2 * i + 1] << 4))
    elif bits == 8:
        for i in range(d):
            out[i] = np.uint8(idx[i])
    else:  # 2, 3, 5, 6 bits: eight indices in `bits` bytes, little-endian
        for g in range(d // 8):
            word = 0
            for k in range(8):
                word |= np.int64(idx[8 * g + k]) << (bits * k)
            for j in range(bits):
                out[bits * g + j] = np.uint8((word >> (8 * j)) & 0xFF)


@njit(cache=True, error_model="numpy", inline="always")
def _unpack_values(code, centroids, bits, out):  # pragma: no cover - jitted
    d = out.shape[0]
    if bits == 4:
        for i in range(d // 2):
            byte = code[i]
            out[2 * i] = centroids[byte & 0xF]
            out[2 * i + 1] = centroids[byte >> 4]
    elif bits == 8:
        for i in range(d):
            out[i] = centroids[code[i]]
    else:
        mask = (1 << bits) - 1
        for g in range(d // 8):
            word = 0
            for j in range(bits):
                word |= np.int64(code[bits * g + j]) << (8 * j)
            for k in range(8):
                out[8 * g + k] = centroids[(word >> (bits * k)) & mask]


CHUNK = 64  # rows per parallel work item: per-row scratch is allocated once per chunk


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def encode_row(x, sgn, boundaries, bits, v, idx, code):  # pragma: no cover - jitted
    """One row x (d,) -> its packed code (into `code`); returns its norm. v, idx: scratch (d,)."""
    d = x.shape[0]
    acc = 0.0
    for i in range(d):
        acc += np.float64(x[i]) * np.float64(x[i])
    nrm = np.float32(math.sqrt(acc))
    inv = np.float32(1.0) / nrm if nrm > 0 else np.float32(1.0)
    for i in range(d):
        v[i] = (x[i] * inv) * sgn[i]
    fwht(v)
    idx[:] = 0
    for k in range(boundaries.shape[0]):  # index = number of boundaries strictly below: branch-free, vectorizes
        bk = boundaries[k]
        for i in range(d):
            idx[i] += np.int32(v[i] > bk)
    _pack(idx, code, bits)
    return nrm


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def encode(x, sgn, boundaries, bits, norms, codes):  # pragma: no cover - jitted
    """x (n, d) f32 -> norms (n,) f32, codes (n, d*bits/8) u8."""
    n, d = x.shape
    for c in prange((n + CHUNK - 1) // CHUNK):
        v = np.empty(d, np.float32)
        idx = np.empty(d, np.int32)
        for r in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
            norms[r] = encode_row(x[r], sgn, boundaries, bits, v, idx, codes[r])


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def decode(norms, codes, sgn, centroids, bits, out):  # pragma: no cover - jitted
    """norms (n,), codes (n, nbytes) -> out (n, d) f32."""
    n, d = out.shape
    for c in prange((n + CHUNK - 1) // CHUNK):
        v = np.empty(d, np.float32)
        for r in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
            _unpack_values(codes[r], centroids, bits, v)
            fwht(v)
            scale = norms[r] / np.float32(d)
            for i in range(d):
                out[r, i] = v[i] * sgn[i] * scale


@njit(cache=True, error_model="numpy", inline="always")
def coded_row(h, r, a, b, centroids, bits, v):  # pragma: no cover - jitted
    """Row r of KV head h in the run of two pieces a then b -> v; returns its norm/d. A piece is
    (norms (Hkv, cap), codes (Hkv, cap, bytes), first buffer row, rows): whole buffers, read in place."""
    if r < a[3]:
        _unpack_values(a[1][h, a[2] + r], centroids, bits, v)
        return a[0][h, a[2] + r] / np.float32(v.shape[0])
    _unpack_values(b[1][h, b[2] + r - a[3]], centroids, bits, v)
    return b[0][h, b[2] + r - a[3]] / np.float32(v.shape[0])


jitcache.tie(globals(), jitcache)  # compiled with its FASTMATH
