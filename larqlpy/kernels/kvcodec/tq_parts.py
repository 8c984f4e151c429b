"""The pieces both decode kernels on codes are made of (tq_attend.py: one sequence's `attend` and a
family's `attend_family`): the query calibrated and rotated, a coded row's logit and value, a block of
16 decoded rows scored and summed (rowdots), a part's rows scored and summed, the softmax, and the
parts' sums rotated back with the sinks' exact values. Each is inlined where it is called."""

from __future__ import annotations

import numpy as np
from numba import njit

from larqlpy.kernels import jitcache, scalars
from larqlpy.kernels.attention import rowdots
from larqlpy.kernels.attention.rowdots import LANES, blocked, dot16, sum16
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.kvcodec import turboquant
from larqlpy.kernels.kvcodec.turboquant import coded_row, fwht
from larqlpy.kernels.scalars import dot, exp

CHUNKS = 16  # parts of a head's rows scored and summed in parallel


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def calibrated(q, inv_scale, mean, qk, bias):  # pragma: no cover - jitted
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
def prepare(q, qk, turning, sgn, qr, coef):  # pragma: no cover - jitted
    """Per query head: the rotated query of the coded keys, and the turning mean's coefficients
    against [cos | sin] (zero without one)."""
    hkv, group, d = q.shape
    half = d // 2
    for h in range(hkv):
        for g in range(group):
            for i in range(d):
                qr[h, g, i] = qk[h, g, i] * sgn[i]
            fwht(qr[h, g])
            for i in range(half):
                if turning.shape[0]:
                    q1, q2, m1, m2 = q[h, g, i], q[h, g, i + half], turning[h, i], turning[h, i + half]
                    coef[h, g, i], coef[h, g, i + half] = q1 * m1 + q2 * m2, q2 * m1 - q1 * m2
                else:
                    coef[h, g, i] = coef[h, g, i + half] = 0.0


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def logit(x, scale, softcap):  # pragma: no cover - jitted
    x *= scale
    return softcap * np.tanh(x / softcap) if softcap > 0 else x


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def score(s, h, r, qr, bias, coef, cs, sc, v, scale, softcap):  # pragma: no cover - jitted
    """KV head h's query heads' logits for coded row r (v, sc as `coded_row` gave them) -> s (H, N)."""
    group = qr.shape[1]
    for g in range(group):
        x = dot(qr[h, g], v) * sc + bias[h, g]
        if cs.shape[0] > 0:
            x += dot(coef[h, g], cs[r])
        s[h * group + g, r] = logit(x, scale, softcap)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def add_values(part, p, h, r, sc, v):  # pragma: no cover - jitted
    """Coded value row r (v, sc as `coded_row` gave them), weighted by KV head h's query heads'
    probabilities p (H, N), added to their sums part (G, D)."""
    group = part.shape[0]
    for g in range(group):
        w = p[h * group + g, r] * sc
        for i in range(v.shape[0]):
            part[g, i] += w * v[i]


@njit(inline="always", cache=True, error_model="numpy")
def scratch(d):  # pragma: no cover - jitted
    """A work item's 16 decoded rows (zeroed: a short block's unused rows are weighted by 0, never
    NaN), their scales, two rows of 16 dot products, the weights of 16 value rows and the rows'
    indices 0..15."""
    at = np.arange(LANES)
    return (np.zeros((LANES, d), np.float32), np.empty(LANES, np.float32), np.empty(LANES, np.float32),
            np.empty(LANES, np.float32), np.empty(LANES, np.float32), at)


@njit(inline="always", cache=True, error_model="numpy")
def chunk_rows(n, d):  # pragma: no cover - jitted
    """Rows a work item takes: n cut into CHUNKS parts by the count alone, rounded up to whole blocks
    of 16 where the head size takes blocks, so no block but a head's last is short (the last parts
    may be short or empty)."""
    step = (n + CHUNKS - 1) // CHUNKS
    return (step + LANES - 1) // LANES * LANES if blocked(d) else step


@njit(inline="always", cache=True, error_model="numpy")
def positions(n):  # pragma: no cover - jitted
    """Row indices into the [cos | sin] table for 16 rows from any r < n: r.., clamped to n - 1."""
    return np.minimum(np.arange(n + LANES), n - 1)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def score_block(s, h, r0, m, qr, bias, coef, cs, pos, work, scale, softcap):  # pragma: no cover - jitted
    """`score` for m <= 16 coded rows from r0, decoded into work's rows with their scales: each query
    head's 16 dot products at once (rowdots.dot16), then the same epilogue a row at a time; other
    head sizes a row at a time."""
    rows, scl, dots, turns, _, at = work
    _, group, d = qr.shape
    if not blocked(d):
        for j in range(m):
            score(s, h, r0 + j, qr, bias, coef, cs, scl[j], rows[j], scale, softcap)
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
            s[h * group + g, r0 + j] = logit(x, scale, softcap)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def sum_block(part, p, h, r0, m, work):  # pragma: no cover - jitted
    """`add_values` for m <= 16 coded rows from r0 decoded into work's rows: each query head's
    weighted sum of the 16 held in registers (rowdots.sum16; weights past m are 0); other head sizes
    a row at a time."""
    rows, scl, _, _, w, at = work
    group, d = part.shape
    if not blocked(d):
        for j in range(m):
            add_values(part, p, h, r0 + j, scl[j], rows[j])
        return
    for g in range(group):
        for j in range(LANES):
            w[j] = p[h * group + g, r0 + j] * scl[j] if j < m else np.float32(0.0)
        sum16(part, g * d, w, 0, rows, at, 0, d)


@njit(inline="always", cache=True, error_model="numpy")
def exact_key(r, ns, klo, mid, tiered):  # pragma: no cover - jitted
    return r < ns or (r >= klo and not (tiered and r >= mid))


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def score_rows(h, lo, hi, q, qr, bias, coef, cs, ka, kb, tka, tkb, keys, sinks, codebooks, bounds, scale, softcap,
                pos, work, s):  # pragma: no cover - jitted
    """Logits of KV head h's query heads over rows [lo, hi) -> s (H, N): exact rows one at a time,
    coded ones in blocks of up to 16 in a row (`score_block`; one for other head sizes)."""
    group, d, klo, mid = q.shape[1], q.shape[2], bounds[0], bounds[1]
    ns, tiered, rows, scl = sinks.shape[1], tka[3] + tkb[3] > 0, work[0], work[1]
    width = LANES if blocked(d) else 1
    r = lo
    while r < hi:
        if exact_key(r, ns, klo, mid, tiered):
            row = sinks[h, r] if r < ns else keys[h, r - klo]
            for g in range(group):
                s[h * group + g, r] = logit(dot(q[h, g], row), scale, softcap)
            r += 1
            continue
        m = 0
        while m < width and r + m < hi and not exact_key(r + m, ns, klo, mid, tiered):
            if r + m < klo:
                scl[m] = coded_row(h, r + m, ka, kb, codebooks[0], codebooks[1], rows[m])
            else:
                scl[m] = coded_row(h, r + m - mid, tka, tkb, codebooks[4], codebooks[5], rows[m])
            m += 1
        score_block(s, h, r, m, qr, bias, coef, cs, pos, work, scale, softcap)
        r += m


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def softmax(s, head, logits):  # pragma: no cover - jitted
    """Row `head` of the scores -> its weights; logits (heads,) or (0,): a learned sink per head
    (GPT-OSS) joined to the sum, with no value row."""
    n = s.shape[1]
    top = s[head, 0]
    for r in range(1, n):
        top = max(top, s[head, r])
    if logits.shape[0]:
        top = max(top, logits[head])
    total = np.float32(0.0) if not logits.shape[0] else exp(logits[head] - top)
    for r in range(n):
        e = exp(s[head, r] - top)
        s[head, r] = e
        total += e
    for r in range(n):
        s[head, r] /= total


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def sum_rows(h, lo, hi, p, va, vb, tva, tvb, codebooks, bounds, ns, work, part):  # pragma: no cover - jitted
    """KV head h's rows [lo, hi) of coded values, weighted, -> part (G, D) in the rotated domain, in
    blocks of up to 16 rows (`sum_block`; one for other head sizes)."""
    mid, rows, scl = bounds[1], work[0], work[1]
    width = LANES if blocked(part.shape[1]) else 1
    for r in range(max(lo, ns), hi, width):
        m = min(width, hi - r)
        for j in range(m):
            if r + j < mid:
                scl[j] = coded_row(h, r + j, va, vb, codebooks[2], codebooks[3], rows[j])
            else:
                scl[j] = coded_row(h, r + j - mid, tva, tvb, codebooks[6], codebooks[7], rows[j])
        sum_block(part, p, h, r, m, work)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def finish(part, p, sink_v, sgn, out):  # pragma: no cover - jitted
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
            fwht(v)
            for i in range(d):
                out[h, g, i] = v[i] * sgn[i]
            for r in range(sink_v.shape[1]):
                w = p[h * group + g, r]
                for i in range(d):
                    out[h, g, i] += w * sink_v[h, r, i]


jitcache.tie(globals(), turboquant, rowdots, scalars, jitcache)
