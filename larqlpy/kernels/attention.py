"""Decode attention on the CPU: one query position per sequence, for any number of sequences in
one jitted call.

torch's SDPA runs a decode step (a few query heads over one KV head) on one thread well below the
speed this loop reaches (docs/benchmarks.md). Each sequence's rows are split into chunks, and each
chunk's KV heads are scored in parallel, each keeping its own running maximum and sum
(flash-decoding), and merged at the end. A KV row is read once for all the query heads that share it
(grouped-query attention), and the head size is a constant in the loops LLVM unrolls. A batch step
hands every sequence's query and rows to one call (`attend_rows`), so 8 sequences cost one call's
Python and dispatch instead of eight. The rows stay where each sequence's store keeps them:
the call takes their addresses.
A sequence's numbers depend on its own rows only, so alone or in a batch they are the same bits.

Rows may be kept in f32, f16 or bf16 (the model's kv_dtype): 16-bit rows are widened to f32 as they
are read, 16 at a time for all the query heads sharing them (a row at a time for other head sizes),
into a buffer that stays in L1, then scored by the same arithmetic; the step's own row is
rounded to the buffer's dtype as it is written (round-to-nearest-even, as torch rounds), so a row
reads back the same whichever path stored it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import carray, njit, prange

from larqlpy.kernels import jitcache, rowdots, scalars
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.rowdots import BF16, F16, F32, LANES, dot16, sum16, widen16
from larqlpy.kernels.scalars import exp, f32_at, from_bf16, from_half, to_bf16, to_half, u16_at

CHUNK = 128  # rows per work item: enough to pay for its set-up, few enough to spread a long sequence
SERIAL_ROWS = 2 * CHUNK  # a call reading no more rows in all runs on one thread: waking the pool costs more
KINDS = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
BLOCK = np.arange(LANES, dtype=np.int64)  # a widened block's rows, in order


@njit(inline="always", cache=True, error_model="numpy")
def _physical(where, s, i):  # pragma: no cover - jitted
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


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _chunk(q, where, s, c, kv, lo, hi, scale, softcap, m, total, acc):  # pragma: no cover - jitted
    """Piece s's readable rows [lo, hi), KV head kv, for that head's query heads (of row where[s, 9]
    of q): chunk c's running maximum, sum and weighted values."""
    h, d = q.shape[1], q.shape[2]
    n_kv, stride, kind = where[s, 4], where[s, 3], where[s, 8]
    rows = where[s, 6] if where[s, 6] > 0 else where[s, 5] + where[s, 2]  # the buffer's rows read from
    group = h // n_kv
    h0, qq, out = kv * group, q[where[s, 9]], acc[c]
    n = hi - lo
    padded = (n + LANES - 1) // LANES * LANES
    at = np.empty(padded, np.int64)
    for i in range(lo, hi):
        at[i - lo] = _physical(where, s, i)
    at[n:] = at[n - 1]
    sc = np.empty((group, padded + 1), np.float32)  # + 1: an odd last row's pair
    wide = np.empty((LANES, d), np.float32)  # 16-bit rows, widened
    k = carray(f32_at(where[s, 0] + 4 * kv * stride), (rows, d))  # this KV head's rows, contiguous
    v = carray(f32_at(where[s, 1] + 4 * kv * stride), (rows, d))
    k16 = carray(u16_at(where[s, 0] + 2 * kv * stride), (rows, d))  # the same, read as 16-bit rows
    v16 = carray(u16_at(where[s, 1] + 2 * kv * stride), (rows, d))
    kv_rows = (k, k16, v, v16, at, kind, wide)
    top, sums = m[c, h0:h0 + group], total[c, h0:h0 + group]
    if d == 64:  # the head size a literal, so LLVM unrolls its loops
        _softmax16(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, 64)
    elif d == 128:
        _softmax16(qq, h0, group, kv_rows, n, scale, softcap, sc, top, sums, out, 128)
    elif d == 256:
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


@njit(inline="always", cache=True, error_model="numpy")
def _write_new(knew, vnew, where):  # pragma: no cover - jitted
    """The step's own K, V row (column where[s, 7] of knew, vnew (Hkv, T, D)) into its store's
    buffer at the last readable row, for the sequences whose store left that to the kernel."""
    d = knew.shape[2]
    for s in range(where.shape[0]):
        col = where[s, 7]
        if col < 0:
            continue
        r, stride, kind = _physical(where, s, where[s, 2] - 1), where[s, 3], where[s, 8]
        for kv in range(where[s, 4]):
            at = kv * stride + r * d
            if kind == F32:
                k = carray(f32_at(where[s, 0] + 4 * at), (d,))
                v = carray(f32_at(where[s, 1] + 4 * at), (d,))
                for j in range(d):
                    k[j] = knew[kv, col, j]
                    v[j] = vnew[kv, col, j]
                continue
            kh = carray(u16_at(where[s, 0] + 2 * at), (d,))
            vh = carray(u16_at(where[s, 1] + 2 * at), (d,))
            for j in range(d):
                if kind == F16:
                    kh[j], vh[j] = to_half(knew[kv, col, j]), to_half(vnew[kv, col, j])
                else:
                    kh[j], vh[j] = to_bf16(knew[kv, col, j]), to_bf16(vnew[kv, col, j])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _merge(m, total, acc, a, b, out):  # pragma: no cover - jitted
    """Chunks [a, b) of one sequence -> its (H, D) output."""
    h, d = acc.shape[1], acc.shape[2]
    for hh in range(h):
        top = m[a, hh]
        for c in range(a + 1, b):
            top = max(top, m[c, hh])
        norm = np.float32(0.0)
        for c in range(a, b):
            norm += total[c, hh] * np.exp(m[c, hh] - top)
        for j in range(d):
            out[hh, j] = 0.0
        for c in range(a, b):
            w = np.exp(m[c, hh] - top) / norm
            for j in range(d):
                out[hh, j] += w * acc[c, hh, j]


@njit(inline="always", cache=True, error_model="numpy")
def _plan(where, n_q):  # pragma: no cover - jitted
    """Piece s owns chunks [first[s], first[s + 1]); owner[c] is chunk c's piece; query i's chunks
    are [by_query[i], by_query[i + 1]) (a query's pieces come together, in order)."""
    n_seq = where.shape[0]
    first = np.empty(n_seq + 1, np.int64)
    first[0] = 0
    for s in range(n_seq):
        first[s + 1] = first[s] + (where[s, 2] + CHUNK - 1) // CHUNK
    owner = np.empty(first[n_seq], np.int64)
    for s in range(n_seq):
        owner[first[s]:first[s + 1]] = s
    by_query = np.empty(n_q + 1, np.int64)
    by_query[n_q] = first[n_seq]
    for s in range(n_seq - 1, -1, -1):
        by_query[where[s, 9]] = first[s]
    return first, owner, by_query


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _item(q, where, first, owner, w, scale, softcap, m, total, acc):  # pragma: no cover - jitted
    """Work item w: chunk w // Hkv, KV head w % Hkv (every piece of a call is one layer's: same Hkv)."""
    c, kv = w // where[0, 4], w % where[0, 4]
    s = owner[c]
    lo = (c - first[s]) * CHUNK
    _chunk(q, where, s, c, kv, lo, min(where[s, 2], lo + CHUNK), scale, softcap, m, total, acc)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _start(q, knew, vnew, where):  # pragma: no cover - jitted
    """A call's new rows written, its plan, and its chunks' running maxima, sums and outputs."""
    _write_new(knew, vnew, where)
    first, owner, by_query = _plan(where, q.shape[0])
    nc, h, d = first[-1], q.shape[1], q.shape[2]
    return first, owner, by_query, np.empty((nc, h), np.float32), np.empty((nc, h), np.float32), \
        np.zeros((nc, h, d), np.float32)


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _attend_rows(q, knew, vnew, where, scale, softcap, out):  # pragma: no cover - jitted
    """q (S, H, D) -> out (S, H, D); where (P, 10) int64 per piece of rows (a sequence's own rows, or
    a prompt's rows its branches share): K and V buffer addresses (row 0 of KV head 0), readable rows
    N, the elements between KV heads, KV heads, the buffer row of the first readable one, the ring's
    rows (0: none), the column of knew, vnew to write as the last readable row first (-1: the store
    wrote it), the rows' element kind (F32, F16, BF16), and the query it serves. Work items are
    (piece, chunk) pairs, so one long sequence spreads over the threads as well as many short ones."""
    first, owner, by_query, m, total, acc = _start(q, knew, vnew, where)
    for w in prange(m.shape[0] * where[0, 4]):
        _item(q, where, first, owner, w, scale, softcap, m, total, acc)
    for s in range(q.shape[0]):  # a few (H, D) sums: not worth waking the threads a second time
        _merge(m, total, acc, by_query[s], by_query[s + 1], out[s])


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _attend_serial(q, knew, vnew, where, scale, softcap, out):  # pragma: no cover - jitted
    """`_attend_rows` on the calling thread: the same work items and merge, so the
    same bits, for a call too small to pay for waking the thread pool."""
    first, owner, by_query, m, total, acc = _start(q, knew, vnew, where)
    for w in range(m.shape[0] * where[0, 4]):
        _item(q, where, first, owner, w, scale, softcap, m, total, acc)
    for s in range(q.shape[0]):
        _merge(m, total, acc, by_query[s], by_query[s + 1], out[s])


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _attend_chunk(q, knew, vnew, where, scale, softcap, out):  # pragma: no cover - jitted
    """A single chunk in all (one sequence, <= CHUNK rows): the same arithmetic, bit for bit, without
    waking the thread pool (which costs more than such a chunk takes)."""
    _write_new(knew, vnew, where)
    first, owner, _ = _plan(where, 1)
    h, d = q.shape[1], q.shape[2]
    m, total, acc = np.empty((1, h), np.float32), np.empty((1, h), np.float32), np.zeros((1, h, d), np.float32)
    for w in range(where[0, 4]):
        _item(q, where, first, owner, w, scale, softcap, m, total, acc)
    _merge(m, total, acc, 0, 1, out[0])


def takes(q: torch.Tensor) -> bool:
    """Whether these kernels serve a query: float32 on the CPU."""
    return q.device.type == "cpu" and q.dtype == torch.float32


class Span(NamedTuple):
    """Where one sequence's decode query reads: `n` rows of k, v (Hkv, rows, D) buffers (float32,
    float16 or bfloat16, both of one dtype) with contiguous rows, from buffer row `first`, wrapping
    at `ring` rows (0: no wrap). With `write` the step's own K, V row is not stored yet: the kernel
    writes it as the last of the n (its store reserved the row), so storing a decode step costs no
    tensor operation of its own. A query may read several spans in order (a branch: its prompt's
    shared rows, then its own), joined as one sequence's chunks are."""

    k: torch.Tensor
    v: torch.Tensor
    first: int
    n: int
    ring: int = 0
    write: bool = False


def attend_rows(q: torch.Tensor, spans: list[Span | tuple[Span, ...]], scale: float, softcap: float = 0.0,
                new: tuple[torch.Tensor, torch.Tensor] | None = None, cols: list[int] | None = None) -> torch.Tensor:
    """One decode query per sequence, q (S, H, D), each over its own rows (`spans`: a Span, or
    several read in order), all float32 on the CPU -> (S, H, D); softcap > 0 caps the scaled scores
    as tanh(s / cap) * cap. `new`: the step's K, V block (Hkv, T, D) and `cols` each sequence's
    column in it, for spans with `write`."""
    n_seq, _, d = q.shape
    rows, held = [], []  # held: tensors copied here, alive until the kernel returns
    for i, (pieces, col) in enumerate(zip(spans, cols or [-1] * n_seq)):
        for sp in ((pieces,) if isinstance(pieces, Span) else pieces):
            k, v = sp.k, sp.v
            if not (k.is_contiguous() or (k.stride(2) == 1 and k.stride(1) == d)) or v.stride() != k.stride() \
                    or v.dtype != k.dtype:
                if sp.write or sp.ring:
                    raise ValueError("a span the kernel writes or wraps must be its store's own buffer")
                k = k[:, sp.first:sp.first + sp.n].contiguous()
                v = v[:, sp.first:sp.first + sp.n].to(k.dtype).contiguous()
                held.append((k, v))
                sp = Span(k, v, 0, sp.n)
            rows.append((k.data_ptr(), v.data_ptr(), sp.n, k.stride(0), k.shape[0], sp.first, sp.ring,
                         col if sp.write else -1, KINDS[k.dtype], i))
    where = np.array(rows, np.int64)
    knew, vnew = (t.numpy() for t in new) if new is not None else (_NONE, _NONE)
    out = np.empty((n_seq, q.shape[1], d), np.float32)
    total = int(where[:, 2].sum())
    kernel = _attend_chunk if len(rows) == 1 and total <= CHUNK else _attend_serial if total <= SERIAL_ROWS \
        else _attend_rows
    kernel(q.contiguous().numpy(), knew, vnew, where, np.float32(scale), np.float32(softcap), out)
    return torch.from_numpy(out)


_NONE = np.zeros((0, 0, 0), np.float32)  # no new rows to write


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q (H, 1, D) over every row of k, v (Hkv, N, D): `attend_rows` for one sequence -> (H, 1, D)."""
    return attend_rows(q.transpose(0, 1), [Span(k, v, 0, k.shape[1])], scale, softcap).transpose(0, 1)


jitcache.tie(globals(), scalars, rowdots, jitcache)  # inlines their helpers and intrinsics; compiled with its FASTMATH
