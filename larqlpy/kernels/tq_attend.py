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
For head sizes 64, 128 and 256 a part's coded rows are decoded 16 at a time into a block, scored and
summed by rowdots.py's two; a family decodes a block's shared rows once for all its branches.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from larqlpy.kernels import jitcache, rowdots, scalars, turboquant
from larqlpy.kernels.scalars import dot, exp
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.rowdots import LANES, blocked, dot16, sum16
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
def _logit(x, scale, softcap):  # pragma: no cover - jitted
    x *= scale
    return softcap * np.tanh(x / softcap) if softcap > 0 else x


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _score(s, h, r, qr, bias, coef, cs, sc, v, scale, softcap):  # pragma: no cover - jitted
    """KV head h's query heads' logits for coded row r (v, sc as `_row` gave them) -> s (H, N)."""
    group = qr.shape[1]
    for g in range(group):
        x = dot(qr[h, g], v) * sc + bias[h, g]
        if cs.shape[0] > 0:
            x += dot(coef[h, g], cs[r])
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


@njit(inline="always", cache=True, error_model="numpy")
def _scratch(d):  # pragma: no cover - jitted
    """A work item's 16 decoded rows (zeroed: a short block's unused rows are weighted by 0, never
    NaN), their scales, two rows of 16 dot products, the weights of 16 value rows and the rows'
    indices 0..15."""
    at = np.arange(LANES)
    return (np.zeros((LANES, d), np.float32), np.empty(LANES, np.float32), np.empty(LANES, np.float32),
            np.empty(LANES, np.float32), np.empty(LANES, np.float32), at)


@njit(inline="always", cache=True, error_model="numpy")
def _step(n, d):  # pragma: no cover - jitted
    """Rows a work item takes: n cut into CHUNKS parts by the count alone, rounded up to whole blocks
    of 16 where the head size takes blocks, so no block but a head's last is short (the last parts
    may be short or empty)."""
    step = (n + CHUNKS - 1) // CHUNKS
    return (step + LANES - 1) // LANES * LANES if blocked(d) else step


@njit(inline="always", cache=True, error_model="numpy")
def _positions(n):  # pragma: no cover - jitted
    """Row indices into the [cos | sin] table for 16 rows from any r < n: r.., clamped to n - 1."""
    return np.minimum(np.arange(n + LANES), n - 1)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _score_block(s, h, r0, m, qr, bias, coef, cs, pos, work, scale, softcap):  # pragma: no cover - jitted
    """`_score` for m <= 16 coded rows from r0, decoded into work's rows with their scales: each query
    head's 16 dot products at once (rowdots.dot16), then the same epilogue a row at a time; other
    head sizes a row at a time."""
    rows, scl, dots, turns, _, at = work
    _, group, d = qr.shape
    if not blocked(d):
        for j in range(m):
            _score(s, h, r0 + j, qr, bias, coef, cs, scl[j], rows[j], scale, softcap)
        return
    one = np.float32(1.0)
    for g in range(group):
        dot16(dots, 0, qr, (h * group + g) * d, rows, at, 0, d, one)
        if cs.shape[0] > 0:
            dot16(turns, 0, coef, (h * group + g) * d, cs, pos, r0, d, one)
        for j in range(m):
            x = dots[j] * scl[j] + bias[h, g]
            if cs.shape[0] > 0:
                x += turns[j]
            s[h * group + g, r0 + j] = _logit(x, scale, softcap)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _sum_block(part, p, h, r0, m, work):  # pragma: no cover - jitted
    """`_add_values` for m <= 16 coded rows from r0 decoded into work's rows: each query head's
    weighted sum of the 16 held in registers (rowdots.sum16; weights past m are 0); other head sizes
    a row at a time."""
    rows, scl, _, _, w, at = work
    group, d = part.shape
    if not blocked(d):
        for j in range(m):
            _add_values(part, p, h, r0 + j, scl[j], rows[j])
        return
    for g in range(group):
        for j in range(LANES):
            w[j] = p[h * group + g, r0 + j] * scl[j] if j < m else np.float32(0.0)
        sum16(part, g * d, w, 0, rows, at, 0, d)


@njit(inline="always", cache=True, error_model="numpy")
def _exact_key(r, ns, klo, mid, tiered):  # pragma: no cover - jitted
    return r < ns or (r >= klo and not (tiered and r >= mid))


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _score_rows(h, lo, hi, q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks, codebooks, bounds, scale, softcap,
                pos, work, s):  # pragma: no cover - jitted
    """Logits of KV head h's query heads over rows [lo, hi) -> s (H, N): exact rows one at a time,
    coded ones in blocks of up to 16 in a row (`_score_block`; one for other head sizes)."""
    group, d, klo, mid = q.shape[1], q.shape[2], bounds[0], bounds[1]
    ns, tiered, rows, scl = sinks.shape[1], tka[3] + tkb[3] > 0, work[0], work[1]
    width = LANES if blocked(d) else 1
    r = lo
    while r < hi:
        if _exact_key(r, ns, klo, mid, tiered):
            row = sinks[h, r] if r < ns else keys[h, r - klo]
            for g in range(group):
                s[h * group + g, r] = _logit(dot(q[h, g], row), scale, softcap)
            r += 1
            continue
        m = 0
        while m < width and r + m < hi and not _exact_key(r + m, ns, klo, mid, tiered):
            if r + m < klo:
                scl[m] = _row(h, r + m, ka, kb, codebooks[0], codebooks[1], rows[m])
            else:
                scl[m] = _row(h, r + m - mid, tka, tkb, codebooks[4], codebooks[5], rows[m])
            m += 1
        _score_block(s, h, r, m, qr, bias, coef, cs, pos, work, scale, softcap)
        r += m


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
def _sum_rows(h, lo, hi, p, va, vb, tva, tvb, codebooks, bounds, ns, work, part):  # pragma: no cover - jitted
    """KV head h's rows [lo, hi) of coded values, weighted, -> part (G, D) in the rotated domain, in
    blocks of up to 16 rows (`_sum_block`; one for other head sizes)."""
    mid, rows, scl = bounds[1], work[0], work[1]
    width = LANES if blocked(part.shape[1]) else 1
    for r in range(max(lo, ns), hi, width):
        m = min(width, hi - r)
        for j in range(m):
            if r + j < mid:
                scl[j] = _row(h, r + j, va, vb, codebooks[2], codebooks[3], rows[j])
            else:
                scl[j] = _row(h, r + j - mid, tva, tvb, codebooks[6], codebooks[7], rows[j])
        _sum_block(part, p, h, r, m, work)


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
    step = _step(n, d)
    pos = _positions(n)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        _score_rows(h, c * step, min(n, (c + 1) * step), q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks,
                    codebooks, bounds, scale, softcap, pos, _scratch(d), s)
    for head in prange(hkv * group):
        _softmax(s, head)
    part = np.zeros((hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        _sum_rows(h, c * step, min(n, (c + 1) * step), s, va, vb, tva, tvb, codebooks, bounds, sinks.shape[1],
                  _scratch(d), part[h, c])
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
    s, ns = np.empty((nb, hkv * group, n), np.float32), sk.shape[1]
    step, pos, width = _step(n, d), _positions(n), LANES if blocked(d) else 1
    for job in prange(hkv * CHUNKS):  # the pieces taken apart: a parallel loop takes arrays, not tuples of them
        h, c = job // CHUNKS, job % CHUNKS
        lo, hi, work = c * step, min(n, (c + 1) * step), _scratch(d)
        for r in range(lo, min(hi, ns)):
            for b in range(nb):
                for g in range(group):
                    s[b, h * group + g, r] = _logit(dot(q[b, h, g], sk[h, r]), scale, softcap)
        for r in range(max(lo, ns), hi, width):
            m = min(width, hi - r)
            for b in range(-1, nb):  # the shared rows, then each branch's own and its scores
                _family_block(h, r, m, b, klo, mid, n, (kn, kc, kf, kr), okn, okc, tkn, tkc, tfirst, trun, kcent,
                              kbits, tkcent, tkbits, work)
                if b >= 0:
                    _score_block(s[b], h, r, m, qr[b], bias[b], coef[b], cs, pos, work, scale, softcap)
    for job in prange(nb * hkv * group):
        _softmax(s[job // (hkv * group)], job % (hkv * group))
    part = np.zeros((nb, hkv, CHUNKS, group, d), np.float32)
    for job in prange(hkv * CHUNKS):
        h, c = job // CHUNKS, job % CHUNKS
        lo, hi, work = c * step, min(n, (c + 1) * step), _scratch(d)
        for r in range(max(lo, ns), hi, width):
            m = min(width, hi - r)
            for b in range(-1, nb):
                _family_block(h, r, m, b, mid, mid, n, (vn, vc, vf, vr), ovn, ovc, tvn, tvc, tfirst, trun, vcent,
                              vbits, tvcent, tvbits, work)
                if b >= 0:
                    _sum_block(part[b, h, c], s[b], h, r, m, work)
    for b in range(nb):
        _finish(part[b], s[b], sv, sgn, out[b])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _family_block(h, r, m, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes, tier_first, tier_run, books,
                  bits, tier_books, tier_bits, work):  # pragma: no cover - jitted
    """Rows r..r+m-1 of KV head h decoded into work's rows and scales: those the family shares when
    b < 0 (decoded once for all), else branch b's own (`_own_row`), the shared ones left as they are."""
    for j in range(m):
        own = r + j >= split or r + j >= shared[3]
        if b < 0 and not own:
            work[1][j] = _row(h, r + j, shared, (shared[0], shared[1], 0, 0), books, bits, work[0][j])
        elif b >= 0 and own:
            work[1][j] = _own_row(h, r + j, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes,
                                  tier_first, tier_run, books, bits, tier_books, tier_bits, work[0][j])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _own_row(h, r, b, split, mid, n, shared, norms, codes, tier_norms, tier_codes, tier_first, tier_run, books, bits,
             tier_books, tier_bits, v):  # pragma: no cover - jitted
    """Branch b's row r past the rows its family shares, as `_row` gives it (-> v, its scale): from its
    recent tier from `split` on (K: klo, V: mid), else from its own main codes after the shared piece."""
    if r >= split:  # the ring's rows from slot `tier_first`, `tier_run` of them before it wraps to slot 0
        return _row(h, r - mid, (tier_norms[b], tier_codes[b], tier_first, tier_run),
                    (tier_norms[b], tier_codes[b], 0, n - mid - tier_run), tier_books, tier_bits, v)
    return _row(h, r, shared, (norms[b], codes[b], 0, norms.shape[2]), books, bits, v)



# inlines turboquant's and rowdots' helpers; compiled with its FASTMATH
jitcache.tie(globals(), turboquant, rowdots, scalars, jitcache)
