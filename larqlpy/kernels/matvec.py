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

from larqlpy.kernels.qweight import PackedPart, PackedWeight


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gemv_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - jitted
    n, k = w.shape
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(k):
            acc += w[i, j] * x[j]
        out[i] = acc


@njit(fastmath=True, cache=True, error_model="numpy")
def _rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: float, offset: float, out: np.ndarray) -> None:  # pragma: no cover - jitted
    n, e = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for j in range(e):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(e) + np.float32(eps))
        for j in range(e):
            out[i, j] = (x[i, j] * r) * (np.float32(offset) + w[j])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (offset + weight) over the last dim, in float32.

    Gemma stores the gain as an offset from 1 (offset 1: a zero-initialised weight is the identity);
    the other families store the gain itself (offset 0). On the CPU in float32 one jitted loop
    replaces torch's five ops: decode runs ~110 norms per token on a few hundred values each, where
    per-op overhead, not arithmetic, is the cost."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        _rms_norm_rows(rows.numpy(), weight.numpy(), eps, offset, out.numpy())
        return out.view(x.shape)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (offset + weight.float())).type_as(x)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for x (T, in), w (out, in) float or packed. One CPU row goes through a streaming kernel."""
    if isinstance(w, (PackedWeight, PackedPart)):
        return w.matmul(x)
    if x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 \
            and w.is_contiguous():
        out = torch.empty(1, w.shape[0], dtype=torch.float32)
        _gemv_f32(w.numpy(), x.reshape(-1).contiguous().numpy(), out.numpy()[0])
        return out
    return F.linear(x, w)


def linears(x: torch.Tensor, *ws) -> tuple[torch.Tensor, ...]:
    """linear(x, w) for matrices sharing the input x; stacked packed parts run as one product."""
    if all(isinstance(w, PackedPart) and w.whole is ws[0].whole for w in ws):
        y = ws[0].whole.matmul(x)  # each part is a column range of the whole product
        return tuple(y[:, w.lo:w.hi] for w in ws)
    return tuple(linear(x, w) for w in ws)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows of the embedding table, float or packed."""
    if isinstance(w, PackedWeight):
        return w.rows(ids.to(w.device))
    return F.embedding(ids, w)
