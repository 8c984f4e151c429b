"""Several packed matrices of one kind, or row ranges of one, each times its own activation rows, in
one parallel region: a mixture's decode step (its chosen experts' gate|up, then their downs), and
DeepSeek's per-head W_UK / W_UV (every head's rows one matrix, each head its own queries), where one
call per matrix spent more in calls and thread wake-ups than the small matrices take to stream.

A segment is (matrix, first tile, end tile, first activation row, rows): those tiles times those
rows. Each tile's numbers come from the same intrinsics in the same order as qdot's kernels give
them (`_int_template`: activations rounded to int8 per group, one DOT call per group and up to
WIDEST rows), so a segment's outputs are `w.matmul(x[rows])`'s bit for bit, whichever thread
takes which chunk (tests/test_qmany.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache, workshare
from larqlpy.kernels.weights import codebytes, qdot, rounding, simd
from larqlpy.kernels.weights.qdot import CHUNKS_PER_SLOT, INT_PATHS, int_kernel
from larqlpy.kernels.weights.rounding import quantize_all
from larqlpy.kernels.weights.qweight import TILE, PackedWeight

# What `_many_template` reads as globals; each kernel binds its own (qdot.int_kernel).
WIDEST = X_PER = FULL = SPAN = 0
DOT = DOT_HALF = DOT_LATE = None


def _many_template(codes, scale, minimum, outer, zc, x, segs, out, ahead, slots):  # pragma: no cover - jitted
    """codes, scale, minimum, outer: tuples of matrices' arrays (one kind, one input width); x (M, k)
    float32; segs (S, 5) int64 (matrix, first tile, end tile, first activation row, rows); out (S,
    rows, >= tiles * TILE) float32: segment s's outputs from column 0. Chunks of a segment's tiles
    are taken from a shared counter (workshare.py); each group's DOT calls as qdot's template makes
    them, up to WIDEST rows a call."""
    m_rows, ng, nb, kw = x.shape[0], scale[0].shape[1], outer[0].shape[1], codes[0].shape[1]
    group = x.shape[1] // ng
    xq8, xs, sxq = np.empty(x.shape, np.int8), np.empty((m_rows, ng), np.float32), np.empty((m_rows, ng), np.int32)
    quantize_all(x, group, xq8, xs, sxq)
    xf, xsf, qf = xq8.view(np.int32).reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    nw, affine, per_block = kw // ng, minimum[0].shape[0] > 0, ng // nb
    chunks = _chunks(segs, slots)
    count = workshare.counter()
    for _ in prange(slots):
        c = workshare.take(count)
        while c < chunks.shape[0]:
            s = chunks[c, 0]
            i, lo, row0, rows = segs[s, 0], segs[s, 1], segs[s, 3], segs[s, 4]
            cf, sf, mf, of = codes[i].reshape(-1), scale[i].reshape(-1), minimum[i].reshape(-1), outer[i].reshape(-1)
            for t in range(chunks[c, 1], chunks[c, 2]):
                acc = np.zeros(rows * TILE, np.float32)
                for g in range(ng):
                    m = 0
                    while m < rows:
                        n, r = min(rows - m, WIDEST), row0 + m
                        a = (n, acc, m * TILE, cf, (t * kw + g * nw) * TILE * SPAN, xf, X_PER * (r * kw + g * nw),
                             X_PER * kw, sf, (t * ng + g) * TILE, mf, of, (t * nb + g // per_block) * 2 * TILE, xsf,
                             qf, r * ng + g, ng, zc, affine, ahead if m == 0 else 0)
                        if nw == FULL:
                            DOT(*a)
                        elif g % 2 == 0:
                            DOT_HALF(*a)
                        else:
                            DOT_LATE(*a)
                        m += n
                for m in range(rows):
                    out[s, m, (t - lo) * TILE:(t - lo + 1) * TILE] = acc[m * TILE:(m + 1) * TILE]
            c = workshare.take(count)


@njit(cache=True, error_model="numpy")
def _chunks(segs, slots):  # pragma: no cover - jitted
    """Each segment's tiles in runs of about (all tiles) / (slots x CHUNKS_PER_SLOT), as qdot's
    kernels split one matrix: (segment, first tile, end tile) a run."""
    tiles = 0
    for s in range(segs.shape[0]):
        tiles += segs[s, 2] - segs[s, 1]
    per = max(1, tiles // (slots * CHUNKS_PER_SLOT))
    n = 0
    for s in range(segs.shape[0]):
        n += (segs[s, 2] - segs[s, 1] + per - 1) // per
    out = np.empty((n, 3), np.int64)
    c = 0
    for s in range(segs.shape[0]):
        for t0 in range(segs[s, 1], segs[s, 2], per):
            out[c, 0], out[c, 1], out[c, 2] = s, t0, min(segs[s, 2], t0 + per)
            c += 1
    return out


MANY = {(isa, bits): int_kernel(_many_template, isa, bits, prefix="_many") for isa in INT_PATHS for bits in simd.WIDTHS
        if simd.fits(isa, bits)}
SLOTS = workshare.slots()


def _kind(w) -> tuple:
    """What must match for matrices to share one kernel call (numba types their arrays as one tuple)."""
    return (w.kind, w.zero, w.group, w.path, w.shape[1],
            tuple((a.dtype, a.ndim, a.flags.c_contiguous) for a in w.arrays))


def one_kind(ws: Sequence) -> bool:
    """Whether `ws` are CPU packed integer matrices of one kind and input width, on one integer path:
    what one `gemm_segments` call takes."""
    return all(isinstance(w, PackedWeight) and w.arrays and w.path in INT_PATHS and w.bits != 16 for w in ws) and \
        len({_kind(w) for w in ws}) == 1


def gemm_segments(ws: Sequence[PackedWeight], x: np.ndarray, segs: np.ndarray) -> np.ndarray:
    """x (M, k) float32 and segments (S, 5) int64 of matrices `ws` (`one_kind`) -> (S, most rows,
    widest segment's outputs) float32: segment s's rows' first (end - first) * TILE outputs, the
    numbers `ws[matrix].matmul` gives those rows of x."""
    w0 = ws[0]
    out = np.empty((segs.shape[0], int(segs[:, 4].max()), int((segs[:, 2] - segs[:, 1]).max()) * TILE), np.float32)
    zc = w0.zero - 128 if w0.path == "avx2-signed" else w0.zero
    MANY[(w0.path, w0.width)](*(tuple(a) for a in zip(*(w.arrays for w in ws))), zc, x, segs, out, w0.ahead, SLOTS)
    return out


def gemm_each(ws: Sequence[PackedWeight], x: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """Matrix i (whole) times row rows[i] of x: (len(ws), widest) float32, matrix i's outputs in
    row i's first ws[i].shape[0] columns."""
    segs = np.array([(i, 0, w.codes.shape[0], r, 1) for i, (w, r) in enumerate(zip(ws, rows))], np.int64)
    return gemm_segments(ws, x, segs.reshape(-1, 5))[:, 0]


def gemm_heads(w: PackedWeight, x: np.ndarray, heads: int) -> np.ndarray | None:
    """x (heads, T, k) float32 times head h's rows of w ((heads x n, k): head h's n rows its h-th
    block, DeepSeek's W_UK / W_UV) -> (heads, T, n); None where a head's rows are no whole tiles."""
    per = w.shape[0] // heads
    if per % TILE or w.shape[0] != heads * per:
        return None
    t, tiles = x.shape[1], per // TILE
    segs = np.array([(0, h * tiles, (h + 1) * tiles, h * t, t) for h in range(heads)], np.int64)
    return gemm_segments([w], x.reshape(heads * t, -1), segs)


@njit(cache=True, error_model="numpy")
def _weighted(d, w, shared, out):  # pragma: no cover - jitted
    """out = d[0] w[0] + d[1] w[1] + ... (+ shared), one float32 rounding an operation, in this order:
    what torch gives the same ops one at a time."""
    for j in range(out.shape[0]):
        out[j] = d[0, j] * w[0]
    for i in range(1, d.shape[0]):
        for j in range(out.shape[0]):
            out[j] = out[j] + d[i, j] * w[i]
    if shared.shape[0]:
        for j in range(out.shape[0]):
            out[j] = out[j] + shared[j]


def weighted_sum(d: np.ndarray, w: np.ndarray, shared: np.ndarray | None) -> np.ndarray:
    """Rows d (k, n) weighted by w (k,) float32 and added in row order, then `shared` (n,) added:
    (n,) float32."""
    out = np.empty(d.shape[1], np.float32)
    _weighted(d, w, np.zeros(0, np.float32) if shared is None else shared, out)
    return out


# they inline simd's intrinsics, qdot's and rounding's jitted helpers
jitcache.tie(globals(), simd, codebytes, jitcache, workshare, qdot, rounding)
