"""Attention for one query position on the CPU (decode), as one jitted kernel.

torch's SDPA runs a decode step (4 query heads over one KV head, D = 256) on one thread at about a
third of the speed this loop reaches: measured 230 us per call over 512-1,500 rows on this machine.
Rows are split into chunks scored in parallel, each keeping its own running maximum and sum
(flash-decoding), and the chunks are merged at the end.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

CHUNK = 128  # rows per parallel chunk: a chunk's K and V (2 x 128 KB at D = 256) stay in L2


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _chunk(q, k, v, scale, softcap, c, lo, hi, m, total, acc):  # pragma: no cover - jitted
    """Rows [lo, hi) for every head: its running maximum, sum and weighted values (chunk c)."""
    h, d = q.shape
    group = h // k.shape[0]
    s = np.empty(hi - lo, np.float32)
    for hh in range(h):
        kv = hh // group
        top = np.float32(-np.inf)
        for i in range(lo, hi):
            dot = np.float32(0.0)
            for j in range(d):
                dot += q[hh, j] * k[kv, i, j]
            dot *= scale
            if softcap > 0:  # Gemma 2's attention softcapping
                dot = softcap * np.tanh(dot / softcap)
            s[i - lo] = dot
            top = max(top, dot)
        tot = np.float32(0.0)
        for i in range(lo, hi):
            e = np.exp(s[i - lo] - top)
            tot += e
            for j in range(d):
                acc[c, hh, j] += e * v[kv, i, j]
        m[c, hh] = top
        total[c, hh] = tot


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _merge(m, total, acc, out):  # pragma: no cover - jitted
    nc, h, d = acc.shape
    for hh in range(h):
        top = m[0, hh]
        for c in range(1, nc):
            top = max(top, m[c, hh])
        norm = np.float32(0.0)
        for c in range(nc):
            norm += total[c, hh] * np.exp(m[c, hh] - top)
        for j in range(d):
            out[hh, j] = 0.0
        for c in range(nc):
            w = np.exp(m[c, hh] - top) / norm
            for j in range(d):
                out[hh, j] += w * acc[c, hh, j]


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attend_one(q, k, v, scale, softcap, out):  # pragma: no cover - jitted
    h, d = q.shape
    n = k.shape[1]
    nc = (n + CHUNK - 1) // CHUNK
    m = np.empty((nc, h), np.float32)
    total = np.empty((nc, h), np.float32)
    acc = np.zeros((nc, h, d), np.float32)
    for c in prange(nc):
        _chunk(q, k, v, scale, softcap, c, c * CHUNK, min(n, (c + 1) * CHUNK), m, total, acc)
    _merge(m, total, acc, out)


@njit(fastmath=True, cache=True, error_model="numpy")
def _attend_small(q, k, v, scale, softcap, out):  # pragma: no cover - jitted
    """One chunk's worth of rows: the same arithmetic without starting the parallel pool (~5 us)."""
    h, d = q.shape
    m = np.empty((1, h), np.float32)
    total = np.empty((1, h), np.float32)
    acc = np.zeros((1, h, d), np.float32)
    _chunk(q, k, v, scale, softcap, 0, 0, k.shape[1], m, total, acc)
    _merge(m, total, acc, out)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q (H, 1, D) over every row of k, v (Hkv, N, D), all float32 on the CPU -> (H, 1, D); softcap > 0
    caps the scaled scores as tanh(s / cap) * cap."""
    out = np.empty((q.shape[0], q.shape[2]), np.float32)
    kernel = _attend_small if k.shape[1] <= CHUNK else _attend_one
    kernel(q[:, 0].contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), np.float32(scale),
           np.float32(softcap), out)
    return torch.from_numpy(out).unsqueeze(1)
