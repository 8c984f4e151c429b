"""A few activation rows times packed integer weight codes, on the CPU (decode and short prefills).

Weight value: scale * (u - zero) (+ minimum, affine formats), per group of G inputs of one output row.

Integer paths (`vnni512`, `avx2`, `avx2-signed`): the activation row x is rounded per group of G
to int8, x ~ xs * xq with xs = max|x| / 127 (llama.cpp's Q8 activations; fbgemm does the same per
row), the group's exact int32 sum  sum(u * xq)  comes from the simd.py intrinsics, and
    y[r] += scale * (xs * (sum(u * xq) - zero * sum(xq)))  (+ minimum * xs * sum(xq)).
The int32 sums are exact and the float steps are the same code in every kernel (no fast-math), so
all integer paths give the same numbers bit for bit: y = W x^ to float32 rounding, x^ = xs * xq.

`float` path: the activations stay float32 (y = W x to float32 rounding). Slower; it runs where the
CPU has neither instruction set and whenever a caller asks for it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from larqlpy.kernels import jitcache, simd
from larqlpy.kernels.simd import BLOCK, DOTS, ROWS as TILE

def as_float(v):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@njit(inline="always", cache=True)
def _half_bits(h):  # pragma: no cover - jitted
    """float16 bits -> float32, exactly (every float16 is a float32)."""
    h = np.int32(h)
    e, m = (h >> 10) & 31, h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    elif e == 0:
        v = np.float32(math.ldexp(np.float32(m), -24))
    else:
        v = np.float32(math.ldexp(np.float32(1024 + m), e - 25))
    return -v if h & 0x8000 else v


@overload(as_float, inline="always")
def _as_float(v):
    """A scale or minimum as float32: stored as float32, or as float16 bits (uint16) where the values
    are float16 exactly (qweight.py), which saves 2 bytes per group."""
    if isinstance(v, types.Integer):
        return lambda v: _half_bits(v)
    return lambda v: v


INT_PATHS = ("vnni512", "avx2", "avx2-signed")
# one row at a time (name), BLOCK rows at a time (name + B); groups of 32 inputs, of 16 (H)
V8, V8H, V4 = (DOTS[("vnni512", b, q, 1)] for b, q in ((8, 8), (8, 4), (4, 8)))
V8B, V8HB, V4B = (DOTS[("vnni512", b, q, BLOCK)] for b, q in ((8, 8), (8, 4), (4, 8)))
A8, A8H, A4 = (DOTS[("avx2", b, q, 1)] for b, q in ((8, 8), (8, 4), (4, 8)))
S8, S8H = (DOTS[("avx2-signed", 8, q, 1)] for q in (8, 4))


@njit(inline="always", cache=True)
def _quantize_row(x, m, group, xq, xs, sxq):  # pragma: no cover - jitted
    for g in range(x.shape[1] // group):
        amax = np.float32(0.0)
        for j in range(g * group, (g + 1) * group):
            amax = max(amax, abs(x[m, j]))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for j in range(g * group, (g + 1) * group):
            q = np.int32(min(127.0, max(-127.0, np.rint(x[m, j] * inv))))
            xq[m, j] = q
            total += q
        xs[m, g], sxq[m, g] = amax / np.float32(127.0), total


@njit(cache=True, error_model="numpy")
def _quantize_few(x, group, xq, xs, sxq):  # pragma: no cover - jitted
    for m in range(x.shape[0]):
        _quantize_row(x, m, group, xq, xs, sxq)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_many(x, group, xq, xs, sxq):  # pragma: no cover - jitted
    for m in prange(x.shape[0]):
        _quantize_row(x, m, group, xq, xs, sxq)


def quantize_activations(x: np.ndarray, group: int, xq: np.ndarray, xs: np.ndarray, sxq: np.ndarray) -> None:
    """x (M, k) float32 -> xq (M, k) int8, xs (M, k/group) float32 = max|x| / 127, sxq (M, k/group)
    int32 = sum(xq). Threads only for many rows: starting them costs more than a few rows take."""
    (_quantize_many if x.shape[0] > 16 else _quantize_few)(x, group, xq, xs, sxq)


# One kernel per instruction set and code width (a kernel that names an instruction the CPU lacks is
# never compiled there). codes: (tiles, k/4 or k/8, TILE, 4) uint8; xq: (M, k/4) int32 (4 x int8).
# The group loop is outside the row loop, so a group's codes are read from memory once per tile.

@njit(parallel=True, cache=True, error_model="numpy")
def _int8_vnni512(codes, scale, minimum, zc, xq, xs, sxq, out):  # pragma: no cover - jitted
    nt, kq, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], xq.shape[0]
    nq, cf, xf, sf, mf, xsf, qf = kq // ng, codes.reshape(-1), xq.reshape(-1), scale.reshape(-1), \
        minimum.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine = minimum.shape[0] > 0
    for t in prange(nt):
        acc = np.zeros(m_rows * TILE, np.float32)
        for g in range(ng):
            base, so, m = (t * kq + g * nq) * TILE * 4, (t * ng + g) * TILE, 0
            while m < m_rows:
                a = (acc, m * TILE, cf, base, xf, m * kq + g * nq, kq, sf, so, mf, xsf, qf, m * ng + g, ng, zc, affine)
                if m + BLOCK <= m_rows:
                    if nq == 8:
                        V8B(*a)
                    else:
                        V8HB(*a)
                    m += BLOCK
                else:
                    if nq == 8:
                        V8(*a)
                    else:
                        V8H(*a)
                    m += 1
        out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)


@njit(parallel=True, cache=True, error_model="numpy")
def _int4_vnni512(codes, scale, minimum, zc, xq, xs, sxq, out):  # pragma: no cover - jitted
    nt, ko, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], xq.shape[0]
    no, cf, xf, sf, mf, xsf, qf = ko // ng, codes.reshape(-1), xq.reshape(-1), scale.reshape(-1), \
        minimum.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine = minimum.shape[0] > 0
    for t in prange(nt):
        acc = np.zeros(m_rows * TILE, np.float32)
        for g in range(ng):
            base, so, m = (t * ko + g * no) * TILE * 4, (t * ng + g) * TILE, 0
            while m < m_rows:
                a = (acc, m * TILE, cf, base, xf, m * 2 * ko + g * 2 * no, 2 * ko, sf, so, mf, xsf, qf, m * ng + g, ng,
                     zc, affine)
                if m + BLOCK <= m_rows:
                    V4B(*a)
                    m += BLOCK
                else:
                    V4(*a)
                    m += 1
        out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)


@njit(parallel=True, cache=True, error_model="numpy")
def _int8_avx2(codes, scale, minimum, zc, xq, xs, sxq, out):  # pragma: no cover - jitted
    nt, kq, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], xq.shape[0]
    nq, cf, xf, sf, mf, xsf, qf = kq // ng, codes.reshape(-1), xq.reshape(-1), scale.reshape(-1), \
        minimum.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine = minimum.shape[0] > 0
    for t in prange(nt):
        acc = np.zeros(m_rows * TILE, np.float32)
        for g in range(ng):
            base, so = (t * kq + g * nq) * TILE * 4, (t * ng + g) * TILE
            for m in range(m_rows):
                a = (acc, m * TILE, cf, base, xf, m * kq + g * nq, kq, sf, so, mf, xsf, qf, m * ng + g, ng, zc, affine)
                if nq == 8:
                    A8(*a)
                else:
                    A8H(*a)
        out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)


@njit(parallel=True, cache=True, error_model="numpy")
def _int8_avx2_signed(codes, scale, minimum, zc, xq, xs, sxq, out):  # pragma: no cover - jitted
    nt, kq, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], xq.shape[0]
    nq, cf, xf, sf, mf, xsf, qf = kq // ng, codes.reshape(-1), xq.reshape(-1), scale.reshape(-1), \
        minimum.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine = minimum.shape[0] > 0
    for t in prange(nt):
        acc = np.zeros(m_rows * TILE, np.float32)
        for g in range(ng):
            base, so = (t * kq + g * nq) * TILE * 4, (t * ng + g) * TILE
            for m in range(m_rows):  # sums of (u - 128) * xq: the caller passes zc = zero - 128
                a = (acc, m * TILE, cf, base, xf, m * kq + g * nq, kq, sf, so, mf, xsf, qf, m * ng + g, ng, zc, affine)
                if nq == 8:
                    S8(*a)
                else:
                    S8H(*a)
        out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)


@njit(parallel=True, cache=True, error_model="numpy")
def _int4_avx2(codes, scale, minimum, zc, xq, xs, sxq, out):  # pragma: no cover - jitted
    nt, ko, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], xq.shape[0]
    no, cf, xf, sf, mf, xsf, qf = ko // ng, codes.reshape(-1), xq.reshape(-1), scale.reshape(-1), \
        minimum.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine = minimum.shape[0] > 0
    for t in prange(nt):
        acc = np.zeros(m_rows * TILE, np.float32)
        for g in range(ng):
            base, so = (t * ko + g * no) * TILE * 4, (t * ng + g) * TILE
            for m in range(m_rows):
                A4(acc, m * TILE, cf, base, xf, m * 2 * ko + g * 2 * no, 2 * ko, sf, so, mf, xsf, qf, m * ng + g, ng, zc,
                   affine)
        out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)


# --- float activations --------------------------------------------------------------------------

@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _float8(codes, scale, minimum, zero, x, xsum, out):  # pragma: no cover - jitted
    nt, kq, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], x.shape[0]
    nq, affine, z = kq // ng, minimum.shape[0] > 0, np.float32(zero)
    words = codes.view(np.uint32)  # (tiles, k/4, TILE, 1): row r's four codes in one 32-bit word
    m8 = np.uint32(255)
    for t in prange(nt):
        acc, s = np.zeros((m_rows, TILE), np.float32), np.empty(TILE, np.float32)
        for g in range(ng):
            for m in range(m_rows):
                s[:] = 0.0
                for p in range(g * nq, (g + 1) * nq):
                    x0, x1, x2, x3 = x[m, 4 * p], x[m, 4 * p + 1], x[m, 4 * p + 2], x[m, 4 * p + 3]
                    for r in range(TILE):
                        w = words[t, p, r, 0]
                        s[r] += ((np.float32(w & m8) - z) * x0 + (np.float32((w >> np.uint32(8)) & m8) - z) * x1) + \
                            ((np.float32((w >> np.uint32(16)) & m8) - z) * x2 + (np.float32(w >> np.uint32(24)) - z) * x3)
                for r in range(TILE):
                    acc[m, r] += as_float(scale[t, g, r]) * s[r]
                if affine:
                    for r in range(TILE):
                        acc[m, r] += as_float(minimum[t, g, r]) * xsum[m, g]
        for m in range(m_rows):
            out[m, t * TILE:(t + 1) * TILE] = acc[m]


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _float4(codes, scale, minimum, zero, x, xsum, out):  # pragma: no cover - jitted
    nt, ko, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], x.shape[0]
    no, affine, z = ko // ng, minimum.shape[0] > 0, np.float32(zero)
    words = codes.view(np.uint32)  # byte i of row r's word: inputs 8o+i (low nibble) and 8o+4+i (high)
    m4 = np.uint32(15)
    for t in prange(nt):
        acc, s = np.zeros((m_rows, TILE), np.float32), np.empty(TILE, np.float32)
        xo = np.empty(8, np.float32)
        for g in range(ng):
            for m in range(m_rows):
                s[:] = 0.0
                for o in range(g * no, (g + 1) * no):
                    for i in range(8):
                        xo[i] = x[m, 8 * o + i]
                    for r in range(TILE):
                        w = words[t, o, r, 0]
                        a = np.float32(w & m4) * xo[0] + np.float32((w >> np.uint32(8)) & m4) * xo[1] + \
                            np.float32((w >> np.uint32(16)) & m4) * xo[2] + np.float32((w >> np.uint32(24)) & m4) * xo[3]
                        b = np.float32((w >> np.uint32(4)) & m4) * xo[4] + np.float32((w >> np.uint32(12)) & m4) * xo[5] + \
                            np.float32((w >> np.uint32(20)) & m4) * xo[6] + np.float32(w >> np.uint32(28)) * xo[7]
                        s[r] += a + b
                for r in range(TILE):
                    acc[m, r] += as_float(scale[t, g, r]) * (s[r] - z * xsum[m, g])
                if affine:
                    for r in range(TILE):
                        acc[m, r] += as_float(minimum[t, g, r]) * xsum[m, g]
        for m in range(m_rows):
            out[m, t * TILE:(t + 1) * TILE] = acc[m]


@njit(cache=True, error_model="numpy")
def group_sums(x, group, out):  # pragma: no cover - jitted
    for m in range(x.shape[0]):
        for g in range(x.shape[1] // group):
            s = np.float32(0.0)
            for j in range(g * group, (g + 1) * group):
                s += x[m, j]
            out[m, g] = s


INT = {("vnni512", 8): _int8_vnni512, ("vnni512", 4): _int4_vnni512, ("avx2", 8): _int8_avx2,
       ("avx2-signed", 8): _int8_avx2_signed, ("avx2", 4): _int4_avx2}
FLOAT = {8: _float8, 4: _float4}


def gemm(codes, scale, minimum, zero: int, bits: int, x: np.ndarray, path: str, out: np.ndarray) -> None:
    """out (M, tiles * TILE) = x (M, k) float32 times the packed codes, on `path`."""
    m_rows, k = x.shape
    group = k // scale.shape[1]
    if path == "float":
        xsum = np.empty((m_rows, scale.shape[1]), np.float32)
        group_sums(x, group, xsum)
        FLOAT[bits](codes, scale, minimum, zero, x, xsum, out)
        return
    xq = np.empty((m_rows, k), np.int8)
    xs, sxq = np.empty((m_rows, k // group), np.float32), np.empty((m_rows, k // group), np.int32)
    quantize_activations(x, group, xq, xs, sxq)
    zc = zero - 128 if path == "avx2-signed" else zero
    INT[(path, bits)](codes, scale, minimum, zc, xq.view(np.int32), xs, sxq, out)


jitcache.tie(globals(), simd)  # the kernels above inline simd.py's intrinsics
