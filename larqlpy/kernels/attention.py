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


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attend_one(q, k, v, scale, softcap, out):  # pragma: no cover - jitted
    h, d = q.shape
    hkv, n, _ = k.shape
    group = h // hkv
    nc = (n + CHUNK - 1) // CHUNK
    m = np.empty((nc, h), np.float32)
    total = np.empty((nc, h), np.float32)
    acc = np.zeros((nc, h, d), np.float32)
    for c in prange(nc):
        lo, hi = c * CHUNK, min(n, (c + 1) * CHUNK)
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


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q (H, 1, D) over every row of k, v (Hkv, N, D), all float32 on the CPU -> (H, 1, D); softcap > 0
    caps the scaled scores as tanh(s / cap) * cap."""
    out = torch.empty(q.shape[0], q.shape[2])
    _attend_one(q[:, 0].contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), np.float32(scale),
                np.float32(softcap), out.numpy())
    return out.unsqueeze(1)
