"""One work item of decode attention (kernels/attention/decode.py): a chunk of one sequence's rows
for one KV head -- its scores for the query heads that share the head, their running maximum and
sum, and the weighted values. 16-bit rows are widened 16 at a time (rowdots) into a buffer that
stays in L1; the head size is a literal in the loops LLVM unrolls (64, 128, 256), and any other
size takes loops that never call the rowdots intrinsics."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from larqlpy.kernels import jitcache, scalars
from larqlpy.kernels.attention import rowdots
from larqlpy.kernels.attention.rowdots import F16, F32, LANES, dot16, sum16, widen16
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.scalars import exp, f32_at, from_bf16, from_half, u16_at

BLOCK = np.arange(LANES, dtype=np.int64)  # a widened block's rows, in order


@njit(inline="always", cache=True, error_model="numpy")
def physical(where, s, i):  # pragma: no cover - jitted
    """Sequence s's i-th readable row -> its row in the buffer (a ring wraps at where[s, 6] rows)."""
    r = where[s, 5] + i
    ring = where[s, 6]
    return r - ring if ring > 0 and r >= ring else r


@njit(inline="always", cache=True, error_model="numpy")
def _widen(src, r, kind, out):  # pragma: no cover - jitted
    """Row r of a KV head's 16-bit rows src (rows, D) -> out (D,) in f32."""
    if kind == F16:
        for j in range(out.shape[0]):
            out[j] = from_half(src[r, j])
    else:
        for j in range(out.shape[0]):
            out[j] = from_bf16(src[r, j])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _dots(q, h0, group, k, r0, r1, sc, i, scale, d):  # pragma: no cover - jitted
    """sc[g, i], sc[g, i + 1] = scale * q[h0 + g] . rows r0, r1 of k: two rows at a time, so each
    query element loaded serves both."""
    for g in range(group):
        d0 = np.float32(0.0)
        d1 = np.float32(0.0)
        for j in range(d):
            d0 += q[h0 + g, j] * k[r0, j]
            d1 += q[h0 + g, j] * k[r1, j]
        sc[g, i] = d0 * scale
        sc[g, i + 1] = d1 * scale


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _scores16(q, h0, group, k, k16, at, n, kind, scale, wide, sc, d):  # pragma: no cover - jitted
    """sc[g, i] = scale * q[h0 + g] . K row at[i], i < n, for the `group` query heads sharing one KV
    head, d one of rowdots.HEAD_DIMS (a literal): 16 rows at a time (rowdots.py; `at` is padded to a
    multiple of 16 with its last row, and sc is as wide). A block of 16-bit rows is widened once for
    all the group's heads, exactly, so it scores as its float32 values do."""
    if kind == F32:
        for g in range(group):
            for i in range(0, n, LANES):
                dot16(sc, g * sc.shape[1] + i, q, (h0 + g) * d, k, at, i, d, scale)
        return
    for i in range(0, n, LANES):  # BLOCK a constant: the widened rows' offsets fold into the code
        widen16(wide, k16, at, i, kind, d)
        for g in range(group):
            dot16(sc, g * sc.shape[1] + i, q, (h0 + g) * d, wide, BLOCK, 0, d, scale)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _scores_pairs(q, h0, group, k, k16, at, n, kind, scale, wide, sc, d):  # pragma: no cover - jitted
    """_scores16 for other head sizes: two rows at a time, a row read (a 16-bit one widened into
    `wide`) once for all the heads, an odd last row paired with itself, so every row's score comes
    from the same arithmetic."""
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        if kind == F32:
            _dots(q, h0, group, k, at[i], at[i1], sc, i, scale, d)
        else:
            _widen(k16, at[i], kind, wide[0])
            _widen(k16, at[i1], kind, wide[1])
            _dots(q, h0, group, wide, 0, 1, sc, i, scale, d)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _values16(p, h0, group, v, v16, at, n, kind, wide, acc, d):  # pragma: no cover - jitted
    """acc[h0 + g] += sum_i p[g, i] * V row at[i], i < n, d one of rowdots.HEAD_DIMS: 16 rows at a
    time per query head, its sums held in registers and taken block after block, in order (p's
    columns past n are zeroed, so `at`'s padding adds nothing); 16-bit blocks widened as in _scores16."""
    p[:, n:] = 0.0
    if kind == F32:
        for g in range(group):
            for i in range(0, n, LANES):
                sum16(acc, (h0 + g) * d, p, g * p.shape[1] + i, v, at, i, d)
        return
    for i in range(0, n, LANES):
        widen16(wide, v16, at, i, kind, d)
        for g in range(group):
            sum16(acc, (h0 + g) * d, p, g * p.shape[1] + i, wide, BLOCK, 0, d)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _values_rows(p, h0, group, v, v16, at, n, kind, wide, acc, d):  # pragma: no cover - jitted
    """_values16 for other head sizes: each row read once for the group's heads."""
    if kind == F32:
        for i in range(n):
            r = at[i]
            for g in range(group):
                e = p[g, i]
                for j in range(d):
                    acc[h0 + g, j] += e * v[r, j]
        return
    for i in range(n):
        _widen(v16, at[i], kind, wide[0])
        for g in range(group):
            e = p[g, i]
            for j in range(d):
                acc[h0 + g, j] += e * wide[0, j]


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _exponentials(sc, softcap, top, total):  # pragma: no cover - jitted
    """Scores sc (G, n) -> e^(s - max) in place, each head's maximum and sum into top, total (G,)."""
    for g in range(sc.shape[0]):
        if softcap > 0:  # Gemma 2's attention softcapping
            for i in range(sc.shape[1]):
                sc[g, i] = softcap * np.tanh(sc[g, i] / softcap)
        t = np.float32(-np.inf)
        for i in range(sc.shape[1]):
            t = max(t, sc[g, i])
        tot = np.float32(0.0)
        for i in range(sc.shape[1]):
            e = exp(sc[g, i] - t)
            sc[g, i] = e
            tot += e
        top[g] = t
        total[g] = tot


HEAD_VALUES = 4096  # query values an item takes at most, where a KV head's query heads are split


@njit(inline="always", cache=True, error_model="numpy")
def parts(h, n_kv, d):  # pragma: no cover - jitted
    """How many work items share one KV head's query heads: one, unless the heads' rows are wide
    (latent attention's 16 heads of 576 values on one KV head: 3 items of 6, 6 and 4 heads), then at most
    HEAD_VALUES query values each. One item of 16 such heads ran a 128-row chunk on one thread."""
    most = max(1, HEAD_VALUES // d)
    return (h // n_kv + most - 1) // most


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def chunk(q, where, s, c, kv, part, lo, hi, scale, softcap, m, total, acc, head):  # pragma: no cover - jitted
    """Piece s's readable rows [lo, hi), KV head kv, for part `part` of that head's query heads (of
    row where[s, 9] of q; `parts`): chunk c's running maximum, sum and weighted values. A head's
    numbers are the same whichever heads share its item: each is scored, exponentiated and summed
    on its own. head: q's head size where it is one of rowdots.HEAD_DIMS, else 0 -- a constant of the
    calling kernel, so numba drops the other sizes' branches and a kernel compiles one head size's
    code (decode.py)."""
    h, d = q.shape[1], q.shape[2]
    n_kv, stride, kind = where[s, 4], where[s, 3], where[s, 8]
    rows = where[s, 6] if where[s, 6] > 0 else where[s, 5] + where[s, 2]  # the buffer's rows read from
    per = (h // n_kv + parts(h, n_kv, d) - 1) // parts(h, n_kv, d)
    group = min(h // n_kv, (part + 1) * per) - part * per
    if group <= 0:
        return
    h0, qq, out = kv * (h // n_kv) + part * per, q[where[s, 9]], acc[c]
    n = hi - lo
    padded = (n + LANES - 1) // LANES * LANES
    at = np.empty(padded, np.int64)
    for i in range(lo, hi):
        at[i - lo] = physical(where, s, i)
    at[n:] = at[n - 1]
    sc = np.empty((group, padded + 1), np.float32)  # + 1: an odd last row's pair
    wide = np.empty((LANES, d), np.float32)  # 16-bit rows, widened
    k = carray(f32_at(where[s, 0] + 4 * kv * stride), (rows, d))  # this KV head's rows, contiguous
    v = carray(f32_at(where[s, 1] + 4 * kv * stride), (rows, d))
    k16 = carray(u16_at(where[s, 0] + 2 * kv * stride), (rows, d))  # the same, read as 16-bit rows
    v16 = carray(u16_at(where[s, 1] + 2 * kv * stride), (rows, d))
    kv_rows = (k, k16, v, v16, at, kind, wide)
    top, sums = m[c, h0:h0 + group], total[c, h0:h0 + group]
    if head == 64:  # the head size a literal, so LLVM unrolls its loops
        _softmax16(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, 64)
    elif head == 128:
        _softmax16(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, 128)
    elif head == 256:
        _softmax16(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, 256)
    else:  # only here the rowdots intrinsics are not compiled in: a kernel's size is memory once loaded
        _softmax_pairs(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, d)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _softmax16(q, h0, group, kv_rows, n, scale, softcap, sc, top, total, out, d):  # pragma: no cover - jitted
    """Scores, their exponentials (running maximum and sum into top, total) and the weighted values
    of one chunk's n rows for the group's query heads; d one of rowdots.HEAD_DIMS, a literal."""
    k, k16, v, v16, at, kind, wide = kv_rows
    _scores16(q, h0, group, k, k16, at, n, kind, scale, wide, sc, d)
    _exponentials(sc[:, :n], softcap, top, total)
    _values16(sc, h0, group, v, v16, at, n, kind, wide, out, d)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _softmax_pairs(q, h0, group, kv_rows, n, scale, softcap, sc, top, total, out, d):  # pragma: no cover - jitted
    """_softmax16 for any other head size."""
    k, k16, v, v16, at, kind, wide = kv_rows
    _scores_pairs(q, h0, group, k, k16, at, n, kind, scale, wide, sc, d)
    _exponentials(sc[:, :n], softcap, top, total)
    _values_rows(sc, h0, group, v, v16, at, n, kind, wide, out, d)


jitcache.tie(globals(), scalars, rowdots, jitcache)  # inlines their helpers and intrinsics; compiled with its FASTMATH
