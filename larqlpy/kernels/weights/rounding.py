"""Activations rounded to int8 per group, as the integer products take them (qdot.py, qmany.py): each
row's groups scaled by max|x| / 127, their sums beside them."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

THREADED_ROWS = 16  # past this many rows activations are rounded on threads: starting them costs more below


@njit(inline="always", cache=True)
def quantize_row(x, m, group, xq, xs, sxq):  # pragma: no cover - jitted
    for g in range(x.shape[1] // group):
        amax = np.float32(0.0)
        for j in range(g * group, (g + 1) * group):
            amax = max(amax, abs(x[m, j]))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for j in range(g * group, (g + 1) * group):
            q = np.int32(min(127.0, max(-127.0, np.rint(x[m, j] * inv))))
            xq[m, j] = q
            total += q
        xs[m, g], sxq[m, g] = amax / np.float32(127.0), total


@njit(cache=True, error_model="numpy")
def _quantize_few(x, group, xq, xs, sxq):  # pragma: no cover - jitted
    for m in range(x.shape[0]):
        quantize_row(x, m, group, xq, xs, sxq)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_many(x, group, xq, xs, sxq):  # pragma: no cover - jitted
    for m in prange(x.shape[0]):
        quantize_row(x, m, group, xq, xs, sxq)


@njit(inline="always", cache=True)
def quantize_all(x, group, xq, xs, sxq):  # pragma: no cover - jitted
    """Every activation row to int8 per group: many rows by one compiled parallel kernel every width's
    product calls (not a parallel loop of each's own, compiled into each), a few inline."""
    if x.shape[0] > THREADED_ROWS:
        _quantize_many(x, group, xq, xs, sxq)
    else:
        for m in range(x.shape[0]):
            quantize_row(x, m, group, xq, xs, sxq)


def quantize_activations(x: np.ndarray, group: int, xq: np.ndarray, xs: np.ndarray, sxq: np.ndarray) -> None:
    """x (M, k) float32 -> xq (M, k) int8, xs (M, k/group) float32 = max|x| / 127, sxq (M, k/group)
    int32 = sum(xq): what the integer kernels do first (`_int_template`), on its own."""
    (_quantize_many if x.shape[0] > THREADED_ROWS else _quantize_few)(x, group, xq, xs, sxq)
