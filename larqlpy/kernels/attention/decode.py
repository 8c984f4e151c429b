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

from types import FunctionType
from typing import NamedTuple

import numpy as np
import torch
from numba import carray, njit, prange

from larqlpy.kernels import jitcache, scalars, workshare
from larqlpy.kernels.attention import chunk as chunks
from larqlpy.kernels.attention import rowdots
from larqlpy.kernels.attention.chunk import chunk, physical
from larqlpy.kernels.attention.rowdots import BF16, F16, F32
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.scalars import f32_at, to_bf16, to_half, u16_at

CHUNK = 128  # rows per work item: enough to pay for its set-up, few enough to spread a long sequence
SERIAL_ROWS = 2 * CHUNK  # a call reading no more rows in all runs on one thread: waking the pool costs more
SLOTS = workshare.slots()
KINDS = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
NO_SINKS = np.zeros(0, np.float32)  # no attention sinks (every family but GPT-OSS)


@njit(inline="always", cache=True, error_model="numpy")
def _write_new(knew, vnew, where):  # pragma: no cover - jitted
    """The step's own K, V row (column where[s, 7] of knew, vnew (Hkv, T, D)) into its store's
    buffer at the last readable row, for the sequences whose store left that to the kernel."""
    d = knew.shape[2]
    for s in range(where.shape[0]):
        col = where[s, 7]
        if col < 0:
            continue
        r, stride, kind = physical(where, s, where[s, 2] - 1), where[s, 3], where[s, 8]
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
def _merge(m, total, acc, a, b, out, sinks):  # pragma: no cover - jitted
    """Chunks [a, b) of one sequence -> its (H, D) output; sinks (H,) or (0,): a logit per head joined
    to the softmax's sum (GPT-OSS), with no value row."""
    h, d = acc.shape[1], acc.shape[2]
    for hh in range(h):
        top = m[a, hh]
        for c in range(a + 1, b):
            top = max(top, m[c, hh])
        if sinks.shape[0]:
            top = max(top, sinks[hh])
        norm = np.float32(0.0)
        for c in range(a, b):
            norm += total[c, hh] * np.exp(m[c, hh] - top)
        if sinks.shape[0]:
            norm += np.exp(sinks[hh] - top)
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
def _item(q, where, first, owner, w, scale, softcap, m, total, acc, head):  # pragma: no cover - jitted
    """Work item w: chunk w // (Hkv P), KV head w // P % Hkv, part w % P of its query heads (P =
    chunks.parts; every piece of a call is one layer's: same Hkv); head: chunk.chunk's."""
    p = chunks.parts(q.shape[1], where[0, 4], q.shape[2])
    c, kv, part = w // (where[0, 4] * p), w // p % where[0, 4], w % p
    s = owner[c]
    lo = (c - first[s]) * CHUNK
    chunk(q, where, s, c, kv, part, lo, min(where[s, 2], lo + CHUNK), scale, softcap, m, total, acc, head)


@njit(inline="always", cache=True, error_model="numpy")
def _items(q, where, m):  # pragma: no cover - jitted
    """A call's work items: chunks x KV heads x parts of their query heads."""
    return m.shape[0] * where[0, 4] * chunks.parts(q.shape[1], where[0, 4], q.shape[2])


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _start(q, knew, vnew, where):  # pragma: no cover - jitted
    """A call's new rows written, its plan, and its chunks' running maxima, sums and outputs."""
    _write_new(knew, vnew, where)
    first, owner, by_query = _plan(where, q.shape[0])
    nc, h, d = first[-1], q.shape[1], q.shape[2]
    return first, owner, by_query, np.empty((nc, h), np.float32), np.empty((nc, h), np.float32), \
        np.zeros((nc, h, d), np.float32)


HEAD = 0  # what the kernels' templates read: the head size they are made for (`_kernels`)


def _attend_rows(q, knew, vnew, where, scale, softcap, sinks, out, slots):  # pragma: no cover - jitted
    """q (S, H, D) -> out (S, H, D); where (P, 10) int64 per piece of rows (a sequence's own rows, or
    a prompt's rows its branches share): K and V buffer addresses (row 0 of KV head 0), readable rows
    N, the elements between KV heads, KV heads, the buffer row of the first readable one, the ring's
    rows (0: none), the column of knew, vnew to write as the last readable row first (-1: the store
    wrote it), the rows' element kind (F32, F16, BF16), and the query it serves. Work items are
    (piece, chunk) pairs, so one long sequence spreads over the threads as well as many short ones;
    a free thread takes the next (workshare.py)."""
    first, owner, by_query, m, total, acc = _start(q, knew, vnew, where)
    items, count = _items(q, where, m), workshare.counter()
    for _ in prange(slots):
        w = workshare.take(count)
        while w < items:
            _item(q, where, first, owner, w, scale, softcap, m, total, acc, HEAD)
            w = workshare.take(count)
    for s in range(q.shape[0]):  # a few (H, D) sums: not worth waking the threads a second time
        _merge(m, total, acc, by_query[s], by_query[s + 1], out[s], sinks)


def _attend_serial(q, knew, vnew, where, scale, softcap, sinks, out):  # pragma: no cover - jitted
    """`_attend_rows` on the calling thread: the same work items and merge, so the
    same bits, for a call too small to pay for waking the thread pool."""
    first, owner, by_query, m, total, acc = _start(q, knew, vnew, where)
    for w in range(_items(q, where, m)):
        _item(q, where, first, owner, w, scale, softcap, m, total, acc, HEAD)
    for s in range(q.shape[0]):
        _merge(m, total, acc, by_query[s], by_query[s + 1], out[s], sinks)


def _attend_chunk(q, knew, vnew, where, scale, softcap, sinks, out):  # pragma: no cover - jitted
    """A single chunk in all (one sequence, <= CHUNK rows): the same arithmetic, bit for bit, without
    waking the thread pool (which costs more than such a chunk takes)."""
    _write_new(knew, vnew, where)
    first, owner, _ = _plan(where, 1)
    h, d = q.shape[1], q.shape[2]
    m, total, acc = np.empty((1, h), np.float32), np.empty((1, h), np.float32), np.zeros((1, h, d), np.float32)
    for w in range(_items(q, where, m)):
        _item(q, where, first, owner, w, scale, softcap, m, total, acc, HEAD)
    _merge(m, total, acc, 0, 1, out[0], sinks)


def _kernels(template, parallel: bool = False) -> dict:
    """`template` as one kernel per head size (rowdots.HEAD_DIMS, and 0 for any other), each of its
    own name (a function, not a closure: qdot.int_kernel says why): a model compiles its own head
    size's code only, where one kernel of all four compiled them all (docs/benchmarks.md, cold start)."""
    out = {}
    for head in (*rowdots.HEAD_DIMS, 0):
        name = f"{template.__name__}_{head or 'any'}"
        fn = FunctionType(template.__code__, {**globals(), "HEAD": head}, name)
        fn.__qualname__ = name
        out[head] = njit(parallel=parallel, fastmath=FASTMATH, cache=True, error_model="numpy")(fn)
    return out


ROWS = _kernels(_attend_rows, parallel=True)
SERIAL = _kernels(_attend_serial)
ONE_CHUNK = _kernels(_attend_chunk)


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
                new: tuple[torch.Tensor, torch.Tensor] | None = None, cols: list[int] | None = None,
                sinks: np.ndarray = NO_SINKS) -> torch.Tensor:
    """One decode query per sequence, q (S, H, D), each over its own rows (`spans`: a Span, or
    several read in order), all float32 on the CPU -> (S, H, D); softcap > 0 caps the scaled scores
    as tanh(s / cap) * cap. `new`: the step's K, V block (Hkv, T, D) and `cols` each sequence's
    column in it, for spans with `write`. `sinks`: a logit per query head (H,) float32 the softmax
    also takes (GPT-OSS), or (0,)."""
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
    work = total * chunks.parts(q.shape[1], int(where[0, 4]), d)  # wide heads: a row is several items' work
    args = (q.contiguous().numpy(), knew, vnew, where, np.float32(scale), np.float32(softcap), sinks, out)
    head = d if d in rowdots.HEAD_DIMS else 0
    if work > SERIAL_ROWS:
        ROWS[head](*args, SLOTS)
    else:
        (ONE_CHUNK if len(rows) == 1 and total <= CHUNK else SERIAL)[head](*args)
    return torch.from_numpy(out)


_NONE = np.zeros((0, 0, 0), np.float32)  # no new rows to write


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0,
               sinks: np.ndarray = NO_SINKS) -> torch.Tensor:
    """q (H, 1, D) over every row of k, v (Hkv, N, D): `attend_rows` for one sequence -> (H, 1, D)."""
    return attend_rows(q.transpose(0, 1), [Span(k, v, 0, k.shape[1])], scale, softcap, sinks=sinks).transpose(0, 1)


# inlines chunk.py's work item, their helpers and intrinsics; compiled with its FASTMATH
jitcache.tie(globals(), chunks, scalars, rowdots, jitcache, workshare)
