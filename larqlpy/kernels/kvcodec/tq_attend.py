"""One decode query attending on a layer's TurboQuant codes in one call: every KV head, every source
of rows, the key calibration's bias, the softmax and the sum of values.

A codec layer's rows come from up to four places, by logical row r of the N it reads:
- r < ns: attention sinks, K and V exact;
- r < klo: K from the main codes; past it, K from the recent tier's codes (r >= mid) or exact;
- r < mid: V from the main codes; past it, V from the tier's codes.
Code sets are read in place as pieces (`coded_row`: a branch's shared prompt rows, then its own).

Scores on codes are taken in the rotated domain (turboquant.py) and get the calibration's bias: the
fixed q . mean and the turning part of q . m_p (calibration.py), sum_i cos(p f_i) c_i + sin(p f_i) c'_i
over the layer's [cos | sin] table. Values from both code sets are summed in the rotated domain
and rotated back once. Rows are cut into CHUNKS parts by their count alone, so where a run is split
between pieces never changes the sums, and a branch decodes the bits of a sequence that never forked.
For head sizes 64, 128 and 256 a part's coded rows are decoded 16 at a time into a block, scored and
summed by rowdots.py's two; a family decodes a block's shared rows once for all its branches.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache, scalars
from larqlpy.kernels.attention import rowdots
from larqlpy.kernels.attention.rowdots import LANES, blocked
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.kvcodec import tq_parts, turboquant
from larqlpy.kernels.kvcodec.tq_parts import (CHUNKS, calibrated, chunk_rows, finish, logit, positions, prepare,
                                              score_block, score_rows, scratch, softmax, sum_block, sum_rows)
from larqlpy.kernels.kvcodec.turboquant import coded_row
from larqlpy.kernels.scalars import dot


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def attend(q, cal, sgn, main, tier, exact, bounds, scale, softcap, logits, out):  # pragma: no cover - jitted
    """q (Hkv, G, D) queries grouped by KV head -> out (Hkv, G, D). cal: the key calibration's 1 / scale,
    mean, turning mean (Hkv, D) and the [cos | sin] rows (N, D) of the rows' positions, each (0, 0)
    when absent (the last two when no head turns): coded keys are scored with q / scale, plus
    q . mean and the turning part. main, tier: (K piece a, K piece b, K centroids, K bits, V a, V b,
    V centroids, V bits), a piece (norms (Hkv, cap), codes (Hkv, cap, bytes), first buffer row,
    rows) (`coded_row`); the tier's pieces have 0 rows when there is none. exact: (exact keys
    (Hkv, N - klo, D), sink K, sink V (Hkv, ns, D)) float32. bounds: (klo, mid, N). logits: a learned
    sink logit per query head (Hkv * G,) the softmax also takes (GPT-OSS), or (0,)."""
    hkv, group, d = q.shape
    n, keys, sinks, sink_v, cs = bounds[2], exact[0], exact[1], exact[2], cal[3]
    ka, kb, va, vb, tka, tkb, tva, tvb = main[0], main[1], main[4], main[5], tier[0], tier[1], tier[4], tier[5]
    codebooks = (main[2], main[3], main[6], main[7], tier[2], tier[3], tier[6], tier[7])  # K, V; tier K, V
    qk, qr, coef = np.empty((hkv, group, d), np.float32), np.empty((hkv, group, d), np.float32), \
        np.empty((hkv, group, d), np.float32)
    bias = np.empty((hkv, group), np.float32)
    calibrated(q, cal[0], cal[1], qk, bias)
    prepare(q, qk, cal[2], sgn, qr, coef)
    s = np.empty((hkv * group, n), np.float32)
    step = chunk_rows(n, d)
    pos = positions(n)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        score_rows(h, c * step, min(n, (c + 1) * step), q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks,
                    codebooks, bounds, scale, softcap, pos, scratch(d), s)
    for head in prange(hkv * group):
        softmax(s, head, logits)
    part = np.zeros((hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        sum_rows(h, c * step, min(n, (c + 1) * step), s, va, vb, tva, tvb, codebooks, bounds, sinks.shape[1],
                  scratch(d), part[h, c])
    finish(part, s, sink_v, sgn, out)


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def attend_family(q, cal, sgn, shared, own, tier, sinks, bounds, scale, softcap, logits,
                  out):  # pragma: no cover - jitted
    """`attend` for B branches of one prompt at one position, in one call: q (B, Hkv, G, D) -> out (B,
    Hkv, G, D). shared: the prompt's K and V code pieces every branch reads (norms, codes, first row,
    rows as arrays and ints: K's four, then V's) and the four codebooks (K centroids, K bits, V, V
    bits); own: each branch's own rows of the main codes past them, from buffer row 0 (K norms
    (B, Hkv, R), K codes (B, Hkv, R, bytes), V norms, V codes); tier: each branch's recent-tier
    ring, the same four, its codebooks, and the slot of its first row read and how many are read
    before the ring wraps to slot 0 (the same in every branch: one position, one ring size);
    sinks: (K, V (Hkv, ns, D)) exact, the same in every branch; bounds (klo, mid, N) the same in
    every branch. A shared row is decoded once for all; each branch's numbers are op for op those
    `attend` gives it alone (the same sums in the same order), so the same bits."""
    nb, hkv, group, d = q.shape
    n, cs, klo, mid = bounds[2], cal[3], bounds[0], bounds[1]
    qk, qr, coef = np.empty(q.shape, np.float32), np.empty(q.shape, np.float32), np.empty(q.shape, np.float32)
    bias = np.empty((nb, hkv, group), np.float32)
    for b in range(nb):
        calibrated(q[b], cal[0], cal[1], qk[b], bias[b])
        prepare(q[b], qk[b], cal[2], sgn, qr[b], coef[b])
    kn, kc, kf, kr, vn, vc, vf, vr = shared[0], shared[1], shared[2], shared[3], shared[4], shared[5], shared[6], \
        shared[7]
    kcent, kbits, vcent, vbits = shared[8], shared[9], shared[10], shared[11]
    okn, okc, ovn, ovc, tkn, tkc, tvn, tvc = own[0], own[1], own[2], own[3], tier[0], tier[1], tier[2], tier[3]
    tkcent, tkbits, tvcent, tvbits, tfirst, trun = tier[4], tier[5], tier[6], tier[7], tier[8], tier[9]
    sk, sv = sinks[0], sinks[1]
    s, ns = np.empty((nb, hkv * group, n), np.float32), sk.shape[1]
    step, pos, width = chunk_rows(n, d), positions(n), LANES if blocked(d) else 1
    for job in prange(hkv * CHUNKS):  # the pieces taken apart: a parallel loop takes arrays, not tuples of them
        h, c = job // CHUNKS, job % CHUNKS
        lo, hi, work = c * step, min(n, (c + 1) * step), scratch(d)
        for r in range(lo, min(hi, ns)):
            for b in range(nb):
                for g in range(group):
                    s[b, h * group + g, r] = logit(dot(q[b, h, g], sk[h, r]), scale, softcap)
        for r in range(max(lo, ns), hi, width):
            m = min(width, hi - r)
            for b in range(-1, nb):  # the shared rows, then each branch's own and its scores
                _family_block(h, r, m, b, klo, mid, n, (kn, kc, kf, kr), okn, okc, tkn, tkc, tfirst, trun, kcent,
                              kbits, tkcent, tkbits, work)
                if b >= 0:
                    score_block(s[b], h, r, m, qr[b], bias[b], coef[b], cs, pos, work, scale, softcap)
    for job in prange(nb * hkv * group):
        softmax(s[job // (hkv * group)], job % (hkv * group), logits)
    part = np.zeros((nb, hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        lo, hi, work = c * step, min(n, (c + 1) * step), scratch(d)
        for r in range(max(lo, ns), hi, width):
            m = min(width, hi - r)
            for b in range(-1, nb):
                _family_block(h, r, m, b, mid, mid, n, (vn, vc, vf, vr), ovn, ovc, tvn, tvc, tfirst, trun, vcent,
                              vbits, tvcent, tvbits, work)
                if b >= 0:
                    sum_block(part[b, h, c], s[b], h, r, m, work)
    for b in range(nb):
        finish(part[b], s[b], sv, sgn, out[b])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _family_block(h, r, m, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes, tier_first, tier_run, books,
                  bits, tier_books, tier_bits, work):  # pragma: no cover - jitted
    """Rows r..r+m-1 of KV head h decoded into work's rows and scales: those the family shares when
    b < 0 (decoded once for all), else branch b's own (`_own_row`), the shared ones left as they are."""
    for j in range(m):
        own = r + j >= split or r + j >= shared[3]
        if b < 0 and not own:
            work[1][j] = coded_row(h, r + j, shared, (shared[0], shared[1], 0, 0), books, bits, work[0][j])
        elif b >= 0 and own:
            work[1][j] = _own_row(h, r + j, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes,
                                  tier_first, tier_run, books, bits, tier_books, tier_bits, work[0][j])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _own_row(h, r, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes, tier_first, tier_run, books, bits,
             tier_books, tier_bits, v):  # pragma: no cover - jitted
    """Branch b's row r past the rows its family shares, as `coded_row` gives it (-> v, its scale): from its
    recent tier from `split` on (K: klo, V: mid), else from its own main codes after the shared piece."""
    if r >= split:  # the ring's rows from slot `tier_first`, `tier_run` of them before it wraps to slot 0
        return coded_row(h, r - mid, (tier_norms[b], tier_codes[b], tier_first, tier_run),
                    (tier_norms[b], tier_codes[b], 0, n - mid - tier_run), tier_books, tier_bits, v)
    return coded_row(h, r, shared, (norms[b], codes[b], 0, norms.shape[2]), books, bits, v)



# inlines turboquant's and rowdots' helpers; compiled with its FASTMATH
jitcache.tie(globals(), tq_parts, turboquant, rowdots, scalars, jitcache)
