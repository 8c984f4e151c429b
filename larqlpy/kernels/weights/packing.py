"""Weights packed for the integer kernels, from float32 or from a GGUF's codes: the load-time
quantization of `int8` and `int4`, and the tiled layout kernels/weights/qweight.py describes (codes per tile
unit-major: quads, octets or 16 inputs; 3-, 5- and 6-bit codes with their high bits beside; per-group
values per tile).
Plain numpy and numba: a packed matrix is made here and held by qweight.PackedWeight."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from larqlpy.kernels.weights.simd import PLANES, parts, span
from larqlpy.kernels.weights.simd import ROWS as TILE

GROUP = 32


# --- quantization from float32 (load time): row-major codes, tiled afterwards ------------------

@njit(parallel=True, cache=True, error_model="numpy")
def search_int4(w, scale, minimum):  # pragma: no cover - jitted
    n, k = w.shape
    for i in prange(n):
        for g in range(k // GROUP):
            lo, hi = w[i, g * GROUP], w[i, g * GROUP]
            for j in range(g * GROUP, (g + 1) * GROUP):
                lo = min(lo, w[i, j])
                hi = max(hi, w[i, j])
            # Round to nearest on the min..max grid, trying a few step counts: a group whose values
            # came from an affine 4-bit grid that never used its top level (common in Q4_K data)
            # is best held by the step count it was written with.
            best_err, best_s = np.inf, np.float32(0.0)
            for steps in range(15, 10, -1):
                s = np.float32((hi - lo) / np.float32(steps))
                inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
                err = 0.0
                for j in range(g * GROUP, (g + 1) * GROUP):
                    qv = min(15.0, np.rint((w[i, j] - lo) * inv))
                    d = np.float32(qv) * s + lo - w[i, j]
                    err += d * d
                if err < best_err:
                    best_err, best_s = err, s
            scale[i, g], minimum[i, g] = best_s, lo


@njit(parallel=True, cache=True, error_model="numpy")
def round_codes(w, scale, minimum, zero, top, u):  # pragma: no cover - jitted
    """u = rint((w - minimum) / scale) + zero, clipped to [1 or 0, top] (minimum empty: symmetric)."""
    n, k = w.shape
    bottom = 1 if minimum.shape[0] == 0 and zero > 0 else 0  # symmetric codes keep -127..127
    for i in prange(n):
        for g in range(k // GROUP):
            s = scale[i, g]
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            m = minimum[i, g] if minimum.shape[0] else np.float32(0.0)
            for j in range(g * GROUP, (g + 1) * GROUP):
                q = np.rint((w[i, j] - m) * inv) + zero
                u[i, j] = np.uint8(min(np.float32(top), max(np.float32(bottom), q)))


def to_half(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (kept as float32) where that costs under 2^-10 of each,
    as a GGUF's Q8_0 / Q4_1 scales are; else the values as they are."""
    h = a.astype(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        close = np.all(np.isfinite(h) & (np.abs(h - a) <= np.float32(2.0 ** -10) * np.abs(a)))
    return h if close else a


@njit(parallel=True, cache=True)
def _tile_high(u, n, bits, out):  # pragma: no cover - jitted
    """Row-major 3-, 5- or 6-bit codes (n, k) -> their tiled layout (tiles, k / unit, TILE * span / 4, 4),
    zeroed beforehand (the last tile's padding rows stay code 0, scale 0); k a multiple of 32."""
    low = 4 if bits > 4 else 2
    n_parts, p = 8 // low, bits - low
    unit, per = 4 * n_parts, 8 // (p * n_parts)  # inputs a unit holds; units a high word spans (simd.high_at)
    slots = TILE // per
    for t in prange(out.shape[0]):
        for r in range(min(TILE, n - t * TILE)):
            row = t * TILE + r
            for o in range(out.shape[1]):
                for i in range(4):
                    b = 0
                    for s in range(n_parts):
                        b |= (np.int32(u[row, unit * o + 4 * s + i]) & ((1 << low) - 1)) << (low * s)
                    out[t, o, r, i] = b
                for i in range(unit):  # the high bits into the row's word for this unit, field parts (o mod per) + s
                    field = n_parts * (o % per) + i // 4
                    high = (np.int32(u[row, unit * o + i]) >> low) << (field * p)
                    out[t, o // per * per + r // slots, TILE + r % slots, i % 4] |= high


@njit(parallel=True, cache=True)
def _tile(words, n, bits, pad, out):  # pragma: no cover - jitted
    """Row-major codes as uint32 words (n, k/4) -> the tiled layout as words (tiles, k/4, k/8 or k/16,
    TILE), 8 / bits words to a unit; rows from n on (the last tile's padding) hold the word `pad`."""
    n_parts = 8 // bits
    for t in prange(out.shape[0]):
        for r in range(TILE):
            row = t * TILE + r
            for o in range(out.shape[1]):
                if row >= n:
                    out[t, o, r] = pad
                    continue
                w = words[row, n_parts * o]
                for s in range(1, n_parts):  # part s's codes bits * s up (every code < 2^bits: no byte spills)
                    w |= words[row, n_parts * o + s] << np.uint32(bits * s)
                out[t, o, r] = w


def fill_byte(bits: int, zero: int) -> int:
    """A byte of the layout at `bits` (8, 4, 2) whose every code is `zero`."""
    return sum(zero << (bits * s) for s in range(8 // bits))


def tile_codes(u: np.ndarray, bits: int, zero: int = 0) -> np.ndarray:
    """Row-major codes (n, k) -> the tiled layout above, the last tile padded with rows of `zero`."""
    n, k = u.shape
    nt = -(-n // TILE)
    if PLANES[bits]:
        out = np.zeros(code_shape(nt, k, bits), np.uint8)
        _tile_high(np.ascontiguousarray(u), n, bits, out)
        return out
    out = np.empty(code_shape(nt, k, bits), np.uint8)
    _tile(np.ascontiguousarray(u).view(np.uint32), n, bits, np.uint32(fill_byte(bits, zero) * 0x01010101),
          out.view(np.uint32)[..., 0])
    return out


def code_shape(tiles: int, k: int, bits) -> tuple[int, int, int, int]:
    """The tiled codes' shape for `tiles` tiles of `k` inputs at `bits` (or a table's name): a unit of
    4 x parts inputs, span / 4 words of TILE rows (the rows' words, then their high words)."""
    return (tiles, k // (4 * parts(bits)), TILE * span(bits) // 4, 4)


def tile_groups(a: np.ndarray) -> np.ndarray:
    """Per-group values (n, groups) -> (tiles, groups, TILE)."""
    n, ng = a.shape
    return np.ascontiguousarray(a.reshape(n // TILE, TILE, ng).transpose(0, 2, 1))
