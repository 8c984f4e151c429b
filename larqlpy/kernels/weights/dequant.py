"""A packed matrix's rows as float32 (qweight.py): rows of integer codes or bf16 dequantized for the
embedding, a slab of tiles at a time for prefill's GEMM, and the 16-bit float GEMV of a few rows (bf16,
and float16 as a GGUF holds it). No
fastmath where codes are dequantized: scale * (u - zero) + minimum must round as two operations,
as torch and gguf-py compute it."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache, scalars
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.weights import qdot, simd
from larqlpy.kernels.weights.qdot import code_at, group_value
from larqlpy.kernels.scalars import from_half
from larqlpy.kernels.weights.simd import ROWS as TILE


@njit(parallel=True, cache=True, error_model="numpy")
def rows_int(codes, scale, minimum, outer, zero, bits, table, idx, out):  # pragma: no cover - jitted
    group, affine = out.shape[1] // scale.shape[1], minimum.shape[0] > 0
    for n in prange(idx.shape[0]):
        t, r = idx[n] // TILE, idx[n] % TILE
        for j in range(out.shape[1]):
            v = group_value(scale, outer, t, j // group, r, 0) * np.float32(code_at(codes, bits, t, j, r, table) - zero)
            out[n, j] = v + group_value(minimum, outer, t, j // group, r, 1) if affine else v


@njit(parallel=True, cache=True, error_model="numpy")
def slab_int(codes, scale, minimum, outer, zero, bits, table, t0, t1, out):  # pragma: no cover - jitted
    group, affine = out.shape[0] // scale.shape[1], minimum.shape[0] > 0
    for t in prange(t0, t1):
        c = (t - t0) * TILE
        for j in range(out.shape[0]):
            g = j // group
            for r in range(TILE):
                v = group_value(scale, outer, t, g, r, 0) * np.float32(code_at(codes, bits, t, j, r, table) - zero)
                out[j, c + r] = v + group_value(minimum, outer, t, g, r, 1) if affine else v


@njit(inline="always", cache=True, error_model="numpy")
def widen(w, t, j, half, bits, vals):  # pragma: no cover - jitted
    """Row tile t's input j as float32 (exact either way): float16 bits, or bfloat16's as a float32's top half."""
    if half:
        for r in range(bits.shape[0]):
            vals[r] = from_half(np.uint16(w[t, j, r]))
    else:
        for r in range(bits.shape[0]):
            bits[r] = np.uint32(np.uint16(w[t, j, r])) << np.uint32(16)


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def gemv_16(w, x, out, ahead, half):  # pragma: no cover - jitted
    """A 16-bit float matrix (half: float16, else bfloat16) times x. ahead: bytes past each input's 64
    values to prefetch (0: none; kernels/weights/prefetch.py)."""
    nt, k, tn = w.shape
    for t in prange(nt):
        acc = np.zeros(tn, np.float32)
        bits = np.empty(tn, np.uint32)
        vals = bits.view(np.float32)
        for j in range(k):
            if ahead > 0:
                at = (t * k + j) * tn * 2 + ahead
                simd.prefetch(w, at)
                simd.prefetch(w, at + 64)
            xj = x[j]
            widen(w, t, j, half, bits, vals)
            for r in range(tn):
                acc[r] += vals[r] * xj
        out[t * tn:(t + 1) * tn] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def rows_16(w, idx, out, half):  # pragma: no cover - jitted
    tn = w.shape[2]
    bits = out.view(np.uint32)
    for n in prange(idx.shape[0]):
        t, r = idx[n] // tn, idx[n] % tn
        for j in range(w.shape[1]):
            if half:
                out[n, j] = from_half(np.uint16(w[t, j, r]))
            else:
                bits[n, j] = np.uint32(np.uint16(w[t, j, r])) << np.uint32(16)


@njit(parallel=True, cache=True, error_model="numpy")
def slab_16(w, t0, t1, out, half):  # pragma: no cover - jitted
    tn = w.shape[2]
    bits = out.view(np.uint32)
    for t in prange(t0, t1):
        c = (t - t0) * tn
        for j in range(w.shape[1]):
            if half:
                for r in range(tn):
                    out[j, c + r] = from_half(np.uint16(w[t, j, r]))
            else:
                for r in range(tn):
                    bits[j, c + r] = np.uint32(np.uint16(w[t, j, r])) << np.uint32(16)


# they inline qdot.py's group_value and scalars' from_half; FASTMATH lives in jitcache
jitcache.tie(globals(), qdot, simd, scalars, jitcache)
