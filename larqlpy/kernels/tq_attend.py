"""One decode query attending on a layer's TurboQuant codes in one call: every KV head, every source
of rows, the key calibration's bias, the softmax and the sum of values.

A codec layer's rows come from up to four places, by logical row r of the N it reads:
- r < ns: attention sinks, K and V exact;
- r < klo: K from the main codes; past it, K from the recent tier's codes (r >= mid) or exact;
- r < mid: V from the main codes; past it, V from the tier's codes.
Code sets are read in place as pieces (`_row`: a branch's shared prompt rows, then its own).

Scores on codes are taken in the rotated domain (turboquant.py) and get the calibration's bias: the
fixed q . mean and the turning part of q . m_p (calibration.py), sum_i cos(p f_i) c_i + sin(p f_i) c'_i
over the layer's [cos | sin] table. Values from both code sets are summed in the rotated domain
and rotated back once. Rows are cut into CHUNKS parts by their count alone, so where a run is split
between pieces never changes the sums, and a branch decodes the bits of a sequence that never forked.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache, scalars, turboquant
from larqlpy.kernels.scalars import exp
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.turboquant import _fwht, _row

CHUNKS = 16  # parts of a head's rows scored and summed in parallel


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _calibrated(q, inv_scale, mean, qk, bias):  # pragma: no cover - jitted
    """Queries of the coded keys (q / scale, as a product: fastmath may estimate a quotient) and
    q . mean; q and 0 without a calibration."""
    hkv, group, d = q.shape
    for h in range(hkv):
        for g in range(group):
            b = np.float32(0.0)
            for i in range(d):
                x = q[h, g, i]
                if inv_scale.shape[0]:
                    b += x * mean[h, i]
                    x = x * inv_scale[h, i]
                qk[h, g, i] = x
            bias[h, g] = b


@njit(cache=True, error_model="numpy")
def calibrate_row(k, first, mean, scale, turning, cs, out):  # pragma: no cover - jitted
    """A decode step's keys k (Hkv, D) at position `first` -> (k - m_p) * scale, op for op what
    calibration.KeyCalibration.apply computes in torch (so a step's codes are a block's); cs: the
    [cos | sin] table, turning (Hkv, D) or empty. k may hold several branches' rows at that
    position, (B * Hkv, D), branch after branch."""
    rows, d = k.shape
    hkv, half = mean.shape[0], d // 2
    for r in range(rows):
        h = r % hkv
        for i in range(d):
            m = mean[h, i]
            if turning.shape[0]:
                c, s_ = cs[first, i % half], cs[first, half + i % half]
                a, b = turning[h, i % half], turning[h, half + i % half]
                m = (a * c - b * s_) + m if i < half else (b * c + a * s_) + m
            out[r, i] = (k[r, i] - m) * scale[h, i]


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _prepare(q, qk, turning, sgn, qr, coef):  # pragma: no cover - jitted
    """Per query head: the rotated query of the coded keys, and the turning mean's coefficients
    against [cos | sin] (zero without one)."""
    hkv, group, d = q.shape
    half = d // 2
    for h in range(hkv):
        for g in range(group):
            for i in range(d):
                qr[h, g, i] = qk[h, g, i] * sgn[i]
            _fwht(qr[h, g])
            for i in range(half):
                if turning.shape[0]:
                    q1, q2, m1, m2 = q[h, g, i], q[h, g, i + half], turning[h, i], turning[h, i + half]
                    coef[h, g, i], coef[h, g, i + half] = q1 * m1 + q2 * m2, q2 * m1 - q1 * m2
                else:
                    coef[h, g, i] = coef[h, g, i + half] = 0.0


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _dot(a, b):  # pragma: no cover - jitted
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _logit(x, scale, softcap):  # pragma: no cover - jitted
    x *= scale
    return softcap * np.tanh(x / softcap) if softcap > 0 else x


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _score(s, h, r, qr, bias, coef, cs, sc, v, scale, softcap):  # pragma: no cover - jitted
    """KV head h's query heads' logits for coded row r (v, sc as `_row` gave them) -> s (H, N)."""
    group = qr.shape[1]
    for g in range(group):
        x = _dot(qr[h, g], v) * sc + bias[h, g]
        if cs.shape[0] > 0:
            x += _dot(coef[h, g], cs[r])
        s[h * group + g, r] = _logit(x, scale, softcap)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _add_values(part, p, h, r, sc, v):  # pragma: no cover - jitted
    """Coded value row r (v, sc as `_row` gave them), weighted by KV head h's query heads'
    probabilities p (H, N), added to their sums part (G, D)."""
    group = part.shape[0]
    for g in range(group):
        w = p[h * group + g, r] * sc
        for i in range(v.shape[0]):
            part[g, i] += w * v[i]


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _score_rows(h, lo, hi, q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks, codebooks, bounds, scale, softcap,
                v, s):  # pragma: no cover - jitted
    """Logits of KV head h's query heads over rows [lo, hi) -> s (H, N)."""
    group, klo, mid = q.shape[1], bounds[0], bounds[1]
    ns, tiered = sinks.shape[1], tka[3] + tkb[3] > 0
    for r in range(lo, hi):
        if r < ns or (r >= klo and not (tiered and r >= mid)):
            row = sinks[h, r] if r < ns else keys[h, r - klo]
            for g in range(group):
                s[h * group + g, r] = _logit(_dot(q[h, g], row), scale, softcap)
            continue
        if r < klo:
            sc = _row(h, r, ka, kb, codebooks[0], codebooks[1], v)
        else:
            sc = _row(h, r - mid, tka, tkb, codebooks[4], codebooks[5], v)
        _score(s, h, r, qr, bias, coef, cs, sc, v, scale, softcap)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _softmax(s, head):  # pragma: no cover - jitted
    n = s.shape[1]
    top = s[head, 0]
    for r in range(1, n):
        top = max(top, s[head, r])
    total = np.float32(0.0)
    for r in range(n):
        e = exp(s[head, r] - top)
        s[head, r] = e
        total += e
    for r in range(n):
        s[head, r] /= total


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _sum_rows(h, lo, hi, p, va, vb, tva, tvb, codebooks, bounds, ns, v, part):  # pragma: no cover - jitted
    """KV head h's rows [lo, hi) of coded values, weighted, -> part (G, D) in the rotated domain."""
    mid = bounds[1]
    for r in range(max(lo, ns), hi):
        if r < mid:
            sc = _row(h, r, va, vb, codebooks[2], codebooks[3], v)
        else:
            sc = _row(h, r - mid, tva, tvb, codebooks[6], codebooks[7], v)
        _add_values(part, p, h, r, sc, v)


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def attend(q, cal, sgn, main, tier, exact, bounds, scale, softcap, out):  # pragma: no cover - jitted
    """q (Hkv, G, D) queries grouped by KV head -> out (Hkv, G, D). cal: the key calibration's 1 / scale,
    mean, turning mean (Hkv, D) and the [cos | sin] rows (N, D) of the rows' positions, each (0, 0)
    when absent (the last two when no head turns): coded keys are scored with q / scale, plus
    q . mean and the turning part. main, tier: (K piece a, K piece b, K centroids, K bits, V a, V b,
    V centroids, V bits), a piece (norms (Hkv, cap), codes (Hkv, cap, bytes), first buffer row,
    rows) (`_row`); the tier's pieces have 0 rows when there is none. exact: (exact keys
    (Hkv, N - klo, D), sink K, sink V (Hkv, ns, D)) float32. bounds: (klo, mid, N)."""
    hkv, group, d = q.shape
    n, keys, sinks, sink_v, cs = bounds[2], exact[0], exact[1], exact[2], cal[3]
    ka, kb, va, vb, tka, tkb, tva, tvb = main[0], main[1], main[4], main[5], tier[0], tier[1], tier[4], tier[5]
    codebooks = (main[2], main[3], main[6], main[7], tier[2], tier[3], tier[6], tier[7])  # K, V; tier K, V
    qk, qr, coef = np.empty((hkv, group, d), np.float32), np.empty((hkv, group, d), np.float32), \
        np.empty((hkv, group, d), np.float32)
    bias = np.empty((hkv, group), np.float32)
    _calibrated(q, cal[0], cal[1], qk, bias)
    _prepare(q, qk, cal[2], sgn, qr, coef)
    s = np.empty((hkv * group, n), np.float32)
    step = (n + CHUNKS - 1) // CHUNKS
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        _score_rows(h, c * step, min(n, (c + 1) * step), q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks,
                    codebooks, bounds, scale, softcap, np.empty(d, np.float32), s)
    for head in prange(hkv * group):
        _softmax(s, head)
    part = np.zeros((hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        _sum_rows(h, c * step, min(n, (c + 1) * step), s, va, vb, tva, tvb, codebooks, bounds, sinks.shape[1],
                  np.empty(d, np.float32), part[h, c])
    _finish(part, s, sink_v, sgn, out)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _finish(part, p, sink_v, sgn, out):  # pragma: no cover - jitted
    """The chunks' sums rotated back, plus the sinks' exact values."""
    hkv, chunks, group, d = part.shape
    v = np.empty(d, np.float32)
    for h in range(hkv):
        for g in range(group):
            for i in range(d):
                acc = np.float32(0.0)
                for c in range(chunks):
                    acc += part[h, c, g, i]
                v[i] = acc
            _fwht(v)
            for i in range(d):
                out[h, g, i] = v[i] * sgn[i]
            for r in range(sink_v.shape[1]):
                w = p[h * group + g, r]
                for i in range(d):
                    out[h, g, i] += w * sink_v[h, r, i]


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def attend_family(q, cal, sgn, shared, own, tier, sinks, bounds, scale, softcap, out):  # pragma: no cover - jitted
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
        _calibrated(q[b], cal[0], cal[1], qk[b], bias[b])
        _prepare(q[b], qk[b], cal[2], sgn, qr[b], coef[b])
    kn, kc, kf, kr, vn, vc, vf, vr = shared[0], shared[1], shared[2], shared[3], shared[4], shared[5], shared[6], \
        shared[7]
    kcent, kbits, vcent, vbits = shared[8], shared[9], shared[10], shared[11]
    okn, okc, ovn, ovc, tkn, tkc, tvn, tvc = own[0], own[1], own[2], own[3], tier[0], tier[1], tier[2], tier[3]
    tkcent, tkbits, tvcent, tvbits, tfirst, trun = tier[4], tier[5], tier[6], tier[7], tier[8], tier[9]
    sk, sv = sinks[0], sinks[1]
    s = np.empty((nb, hkv * group, n), np.float32)
    step = (n + CHUNKS - 1) // CHUNKS
    for job in prange(hkv * CHUNKS):  # the pieces taken apart: a parallel loop takes arrays, not tuples of them
        h, c = job // CHUNKS, job % CHUNKS
        v, sc = np.empty(d, np.float32), np.float32(0.0)
        for r in range(c * step, min(n, (c + 1) * step)):
            if r < sk.shape[1]:
                for b in range(nb):
                    for g in range(group):
                        s[b, h * group + g, r] = _logit(_dot(q[b, h, g], sk[h, r]), scale, softcap)
                continue
            if r < klo and r < kr:
                sc = _row(h, r, (kn, kc, kf, kr), (kn, kc, 0, 0), kcent, kbits, v)
            for b in range(nb):
                if r >= klo or r >= kr:
                    sc = _own_row(h, r, b, klo, mid, n, (kn, kc, kf, kr), okn, okc, tkn, tkc, tfirst, trun, kcent,
                                  kbits, tkcent, tkbits, v)
                _score(s[b], h, r, qr[b], bias[b], coef[b], cs, sc, v, scale, softcap)
    for job in prange(nb * hkv * group):
        _softmax(s[job // (hkv * group)], job % (hkv * group))
    part = np.zeros((nb, hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        v, sc = np.empty(d, np.float32), np.float32(0.0)
        for r in range(max(c * step, sk.shape[1]), min(n, (c + 1) * step)):
            if r < mid and r < vr:
                sc = _row(h, r, (vn, vc, vf, vr), (vn, vc, 0, 0), vcent, vbits, v)
            for b in range(nb):
                if r >= mid or r >= vr:
                    sc = _own_row(h, r, b, mid, mid, n, (vn, vc, vf, vr), ovn, ovc, tvn, tvc, tfirst, trun, vcent,
                                  vbits, tvcent, tvbits, v)
                _add_values(part[b, h, c], s[b], h, r, sc, v)
    for b in range(nb):
        _finish(part[b], s[b], sv, sgn, out[b])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _own_row(h, r, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes, tier_first, tier_run, books, bits,
             tier_books, tier_bits, v):  # pragma: no cover - jitted
    """Branch b's row r past the rows its family shares, as `_row` gives it (-> v, its scale): from its
    recent tier from `split` on (K: klo, V: mid), else from its own main codes after the shared piece."""
    if r >= split:  # the ring's rows from slot `tier_first`, `tier_run` of them before it wraps to slot 0
        return _row(h, r - mid, (tier_norms[b], tier_codes[b], tier_first, tier_run),
                    (tier_norms[b], tier_codes[b], 0, n - mid - tier_run), tier_books, tier_bits, v)
    return _row(h, r, shared, (norms[b], codes[b], 0, norms.shape[2]), books, bits, v)



jitcache.tie(globals(), turboquant, scalars, jitcache)  # inlines turboquant's helpers; compiled with its FASTMATH
