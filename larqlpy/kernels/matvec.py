"""Matrix-vector products for decode on CPU.

Decode multiplies one activation row by every weight matrix, so it is bound by how fast the weights
stream from memory. MKL's sgemv reaches about a third of this machine's read bandwidth on the tied
LM head (262,144 x 640); a plain row-parallel dot product in numba streams at close to the full rate.
Prefill (many rows) stays on torch's GEMM, which is compute-bound and already good.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - jitted
    n, k = w.shape
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(k):
            acc += w[i, j] * x[j]
        out[i] = acc


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x (T, in), w (out, in). One CPU float32 row goes through the streaming kernel."""
    if x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 \
            and w.is_contiguous():
        out = torch.empty(1, w.shape[0], dtype=torch.float32)
        _gemv_f32(w.numpy(), x.reshape(-1).contiguous().numpy(), out.numpy()[0])
        return out
    return F.linear(x, w)
