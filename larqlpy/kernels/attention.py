"""Decode attention on the CPU: one query position per sequence, for any number of sequences in
one jitted call.

torch's SDPA runs a decode step (4 query heads over one KV head, D = 256) on one thread at about a
third of the speed this loop reaches: measured 230 us per call over 512-1,500 rows. Each sequence's
rows are split into chunks scored in parallel, each keeping its own running maximum and sum
(flash-decoding), and merged at the end. A batch step hands every sequence's query and rows to one
call (`attend_rows`), so 8 sequences cost one call instead of eight (each ~30-60 us of Python and
dispatch). The rows stay where each sequence's store keeps them: the call takes their addresses.
A sequence's numbers depend on its own rows only, so alone or in a batch they are the same bits.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange, types
from numba.extending import intrinsic

CHUNK = 128  # rows per parallel chunk: a chunk's K and V (2 x 128 KB at D = 256) stay in L2


@intrinsic
def _f32_at(typingctx, address):
    """An int64 address as a float32 pointer (for numba.carray): rows that live in a store's tensor."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _chunk(q, where, s, c, lo, hi, scale, softcap, m, total, acc):  # pragma: no cover - jitted
    """Sequence s's rows [lo, hi) for every head: chunk c's running maximum, sum and weighted values."""
    h, d = q.shape[1], q.shape[2]
    n_kv, n, stride = where[s, 4], where[s, 2], where[s, 3]
    group = h // n_kv
    sc = np.empty(hi - lo, np.float32)
    for kv in range(n_kv):
        k = carray(_f32_at(where[s, 0] + 4 * kv * stride), (n, d))  # this KV head's rows, contiguous
        v = carray(_f32_at(where[s, 1] + 4 * kv * stride), (n, d))
        for hh in range(kv * group, (kv + 1) * group):
            top = np.float32(-np.inf)
            for i in range(lo, hi):
                dot = np.float32(0.0)
                for j in range(d):
                    dot += q[s, hh, j] * k[i, j]
                dot *= scale
                if softcap > 0:  # Gemma 2's attention softcapping
                    dot = softcap * np.tanh(dot / softcap)
                sc[i - lo] = dot
                top = max(top, dot)
            tot = np.float32(0.0)
            for i in range(lo, hi):
                e = np.exp(sc[i - lo] - top)
                tot += e
                for j in range(d):
                    acc[c, hh, j] += e * v[i, j]
            m[c, hh] = top
            total[c, hh] = tot


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
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
def _plan(where):  # pragma: no cover - jitted
    """Sequence s owns chunks [first[s], first[s + 1]); owner[c] is chunk c's sequence."""
    n_seq = where.shape[0]
    first = np.empty(n_seq + 1, np.int64)
    first[0] = 0
    for s in range(n_seq):
        first[s + 1] = first[s] + (where[s, 2] + CHUNK - 1) // CHUNK
    owner = np.empty(first[n_seq], np.int64)
    for s in range(n_seq):
        owner[first[s]:first[s + 1]] = s
    return first, owner


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _item(q, where, first, owner, c, scale, softcap, m, total, acc):  # pragma: no cover - jitted
    s = owner[c]
    lo = (c - first[s]) * CHUNK
    _chunk(q, where, s, c, lo, min(where[s, 2], lo + CHUNK), scale, softcap, m, total, acc)


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attend_rows(q, where, scale, softcap, out):  # pragma: no cover - jitted
    """q (S, H, D) -> out (S, H, D); where (S, 5) int64 per sequence: K and V addresses (row 0 of KV
    head 0), rows N, the elements between KV heads, KV heads. Work items are (sequence, chunk) pairs,
    so one long sequence spreads over the threads as well as many short ones."""
    first, owner = _plan(where)
    nc, h, d = first[-1], q.shape[1], q.shape[2]
    m, total, acc = np.empty((nc, h), np.float32), np.empty((nc, h), np.float32), np.zeros((nc, h, d), np.float32)
    for c in prange(nc):
        _item(q, where, first, owner, c, scale, softcap, m, total, acc)
    for s in prange(q.shape[0]):
        _merge(m, total, acc, first[s], first[s + 1], out[s])


@njit(fastmath=True, cache=True, error_model="numpy")
def _attend_chunk(q, where, scale, softcap, out):  # pragma: no cover - jitted
    """A single chunk in all (one sequence, <= CHUNK rows): the same arithmetic, bit for bit, without
    waking the thread pool (which costs more than such a chunk takes)."""
    first, owner = _plan(where)
    h, d = q.shape[1], q.shape[2]
    m, total, acc = np.empty((1, h), np.float32), np.empty((1, h), np.float32), np.zeros((1, h, d), np.float32)
    _item(q, where, first, owner, 0, scale, softcap, m, total, acc)
    _merge(m, total, acc, 0, 1, out[0])


def takes(q: torch.Tensor) -> bool:
    """Whether these kernels serve a query: float32 on the CPU."""
    return q.device.type == "cpu" and q.dtype == torch.float32


def attend_rows(q: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                softcap: float = 0.0) -> torch.Tensor:
    """One decode query per sequence, q (S, H, D), each over every row of its own k, v (Hkv, N_s, D),
    all float32 on the CPU -> (S, H, D); softcap > 0 caps the scaled scores as tanh(s / cap) * cap."""
    n_seq, _, d = q.shape
    held = []  # the tensors whose addresses the kernel reads: alive until it returns
    for k, v in rows:
        if k.stride(2) != 1 or k.stride(1) != d or v.stride() != k.stride():
            k, v = k.contiguous(), v.contiguous()
        held.append((k.data_ptr(), v.data_ptr(), k.shape[1], k.stride(0), k.shape[0], k, v))
    where = np.array([h[:5] for h in held], np.int64)
    out = np.empty((n_seq, q.shape[1], d), np.float32)
    kernel = _attend_chunk if n_seq == 1 and where[0, 2] <= CHUNK else _attend_rows
    kernel(q.contiguous().numpy(), where, np.float32(scale), np.float32(softcap), out)
    return torch.from_numpy(out)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q (H, 1, D) over every row of k, v (Hkv, N, D): `attend_rows` for one sequence -> (H, 1, D)."""
    return attend_rows(q.transpose(0, 1), [(k, v)], scale, softcap).transpose(0, 1)
