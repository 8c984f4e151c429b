"""Products, norms and RoPE for the decoder on the CPU, in float32, and their torch twins elsewhere.

Decode multiplies one activation row by every weight matrix, so it is bound by how fast the weights
stream from memory. For float32 weights a plain row-parallel dot product in numba beat MKL's sgemv
on the tied LM head on one machine and lost to it on another: the first product of each shape
measures both (choice.py). Prefill (many rows) stays on torch's GEMM. Norms and RoPE run as jitted
loops: decode runs a hundred-odd norms a token on a few hundred values each, where torch's per-op
overhead, not arithmetic, is the cost.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from larqlpy.kernels import jitcache, scalars, workshare
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.scalars import dot, exp
from larqlpy.kernels.weights.choice import choose
from larqlpy.kernels.weights.qweight import PackedPart, PackedWeight


CHUNK = 64  # weight rows a thread takes at a time (workshare.py)
SLOTS = workshare.slots()


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _gemm_few_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray, slots: int) -> None:  # pragma: no cover - jitted
    """x (M, k) times w: each weight row streamed from memory once for all M rows (torch's GEMM
    reads them once per few rows: docs/weights.md), each product one `dot`, whatever thread takes it."""
    count, chunks = workshare.counter(), (w.shape[0] + CHUNK - 1) // CHUNK
    for _ in prange(slots):
        c = workshare.take(count)
        while c < chunks:
            for i in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                for m in range(x.shape[0]):
                    out[m, i] = dot(w[i], x[m])
            c = workshare.take(count)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _norm_into(x, w, eps, offset, out):  # pragma: no cover - jitted
    """One row: out = x * rsqrt(mean(x^2) + eps) * (offset + w)."""
    e = x.shape[0]
    ss = np.float32(0.0)
    for j in range(e):
        ss += x[j] * x[j]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(e) + np.float32(eps))
    for j in range(e):
        out[j] = (x[j] * r) * (np.float32(offset) + w[j])


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: float, offset: float,
                   out: np.ndarray) -> None:  # pragma: no cover - jitted
    for i in range(x.shape[0]):
        _norm_into(x[i], w, eps, offset, out[i])


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _residual_norm(x, a, wa, wh, eps, offset, x_out, h_out):  # pragma: no cover - jitted
    """x_out = x + norm(a, wa) (x + a when wa is empty); h_out = norm(x_out, wh) unless wh is empty."""
    t, e = x.shape
    na = np.empty(e, np.float32)
    for i in range(t):
        if wa.shape[0]:
            _norm_into(a[i], wa, eps, offset, na)
            for j in range(e):
                x_out[i, j] = x[i, j] + na[j]
        else:
            for j in range(e):
                x_out[i, j] = x[i, j] + a[i, j]
        if wh.shape[0]:
            _norm_into(x_out[i], wh, eps, offset, h_out[i])


@njit(inline="always", cache=True, error_model="numpy")
def _head_into(seg, w, eps, offset, cos, sin, row, out):  # pragma: no cover - jitted
    """One head's row normed by w (unless w is empty), then rotated (rotate-half) into out. The
    rotation computes x * cos + rotated * sin as torch does, op for op."""
    d = cos.shape[0]
    half = d // 2
    if w.shape[0]:
        _norm_into(seg, w, eps, offset, row)
    else:
        row[:] = seg
    for j in range(half):
        out[j] = row[j] * cos[j] + (-row[j + half]) * sin[j]
    for j in range(half, d):
        out[j] = row[j] * cos[j] + row[j - half] * sin[j]


@njit(cache=True, error_model="numpy")
def _norm_rope(x, heads, w, eps, offset, cos, sin, out):  # pragma: no cover - jitted
    """x (T, heads * D) -> out (heads, T, D): each head's row normed and rotated (_head_into)."""
    d = cos.shape[1]
    row = np.empty(d, np.float32)
    for i in range(x.shape[0]):
        for hh in range(heads):
            _head_into(x[i, hh * d:(hh + 1) * d], w, eps, offset, cos[i], sin[i], row, out[hh, i])


@njit(cache=True, error_model="numpy")
def _qkv_rope(x, bias, qw, kw, eps, offset, cos, sin, q, k, v):  # pragma: no cover - jitted
    """x (T, (H + 2 Hkv) * D), a stacked q|k|v product, plus bias (unless empty) -> q (H, T, D),
    k, v (Hkv, T, D); q and k heads normed and rotated (_head_into), as the ops apart compute it."""
    d, heads, kv = cos.shape[1], q.shape[0], k.shape[0]
    row, seg = np.empty(d, np.float32), np.empty(d, np.float32)
    for i in range(x.shape[0]):
        for hh in range(heads + 2 * kv):
            for j in range(d):
                seg[j] = x[i, hh * d + j] + bias[hh * d + j] if bias.shape[0] else x[i, hh * d + j]
            if hh < heads:
                _head_into(seg, qw, eps, offset, cos[i], sin[i], row, q[hh, i])
            elif hh < heads + kv:
                _head_into(seg, kw, eps, offset, cos[i], sin[i], row, k[hh - heads, i])
            else:
                v[hh - heads - kv, i, :] = seg


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _gated(x, gelu, out):  # pragma: no cover - jitted
    """x (T, 2I), a stacked gate|up product -> out (T, I) = act(gate) * up: SiLU, or GELU's tanh
    form, over an exponential LLVM vectorizes (scalars.exp)."""
    n = out.shape[1]
    for i in range(x.shape[0]):
        for j in range(n):
            g = x[i, j]
            if gelu:  # 0.5 g (1 + tanh(y)), tanh(y) = 1 - 2 / (e^2y + 1)
                y = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
                a = np.float32(0.5) * g * (np.float32(2.0) - np.float32(2.0) / (
                    exp(min(np.float32(2.0) * y, np.float32(88.0))) + np.float32(1.0)))
            else:
                a = g / (np.float32(1.0) + exp(min(-g, np.float32(88.0))))
            out[i, j] = a * x[i, n + j]


NO_WEIGHT = np.zeros(0, np.float32)


def _cpu_f32(x: torch.Tensor) -> bool:
    """Whether activations x take the jitted loops: float32 on the CPU. Only the activations are
    asked: the loader gives a model's norms, biases and RoPE tables the activations' dtype and device,
    and decode asks this ~100 times a token."""
    return x.dtype is torch.float32 and x.is_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (offset + weight) over the last dim, in float32.

    Gemma stores the gain as an offset from 1 (offset 1: a zero-initialised weight is the identity);
    the other families store the gain itself (offset 0). On the CPU in float32 one jitted loop
    replaces torch's five ops: decode runs ~110 norms per token on a few hundred values each, where
    per-op overhead, not arithmetic, is the cost."""
    if _cpu_f32(x):
        rows = (x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()).numpy()
        out = np.empty_like(rows)
        _rms_norm_rows(rows, weight.numpy(), eps, offset, out)
        return torch.from_numpy(out).view(x.shape)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (offset + weight.float())).type_as(x)


def residual_norm(x: torch.Tensor, a: torch.Tensor, wa: torch.Tensor | None, wh: torch.Tensor | None, eps: float,
                  offset: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + norm(a, wa), norm(that, wh)): a residual step and the next pre-norm (wa None: x + a;
    wh None: no second norm). One jitted call on the CPU in float32, the same numbers as the ops."""
    if _cpu_f32(x) and x.dim() == 2:
        xs, as_ = x.contiguous().numpy(), a.contiguous().numpy()
        x_out = np.empty_like(xs)
        h_out = np.empty_like(xs) if wh is not None else np.empty((0, 0), np.float32)
        _residual_norm(xs, as_, NO_WEIGHT if wa is None else wa.numpy(), NO_WEIGHT if wh is None else wh.numpy(),
                       eps, offset, x_out, h_out)
        return torch.from_numpy(x_out), (torch.from_numpy(h_out) if wh is not None else None)
    x = x + (a if wa is None else rms_norm(a, wa, eps, offset))
    return x, (None if wh is None else rms_norm(x, wh, eps, offset))


def norm_rope(x: torch.Tensor, heads: int, w: torch.Tensor | None, eps: float, offset: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads * D) -> (heads, T, D), each head normed by w (q/k norms; None: not normed) and
    rotated by RoPE (rotate-half layout, HF's). One jitted call on the CPU in float32."""
    t, d = x.shape[0], cos.shape[-1]
    if _cpu_f32(x):
        out = np.empty((heads, t, d), np.float32)
        _norm_rope(x.numpy(), heads, NO_WEIGHT if w is None else w.numpy(), eps, offset, cos.numpy(), sin.numpy(), out)
        return torch.from_numpy(out)
    y = x.view(t, heads, d).transpose(0, 1)
    if w is not None:
        y = rms_norm(y, w, eps, offset)
    half = d // 2
    return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin


def qkv_rope(qkv: torch.Tensor, bias: torch.Tensor | None, heads: int, kv: int, qw: torch.Tensor | None,
             kw: torch.Tensor | None, eps: float, offset: float, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stacked q|k|v product (T, (heads + 2 kv) * D) -> q (heads, T, D), k, v (kv, T, D): the
    bias added, q and k normed per head (qw, kw; None: not normed) and rotated. One jitted call on
    the CPU in float32, where the ops apart cost a layer a dozen torch and numba calls."""
    t, d = qkv.shape[0], cos.shape[-1]
    if _cpu_f32(qkv) and qkv.is_contiguous():
        q, k, v = np.empty((heads, t, d), np.float32), np.empty((kv, t, d), np.float32), \
            np.empty((kv, t, d), np.float32)
        _qkv_rope(qkv.numpy(), NO_WEIGHT if bias is None else bias.numpy(), NO_WEIGHT if qw is None else qw.numpy(),
                  NO_WEIGHT if kw is None else kw.numpy(), eps, offset, cos.numpy(), sin.numpy(), q, k, v)
        return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)
    if bias is not None:
        qkv = qkv + bias
    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=1)
    return norm_rope(q, heads, qw, eps, offset, cos, sin), norm_rope(k, kv, kw, eps, offset, cos, sin), \
        v.reshape(t, kv, d).transpose(0, 1)


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """A stacked gate|up product (T, 2I) -> act(gate) * up (T, I); activation: silu | gelu_tanh.
    One jitted call on the CPU in float32."""
    n = gate_up.shape[1] // 2
    if _cpu_f32(gate_up) and gate_up.is_contiguous():
        out = np.empty((gate_up.shape[0], n), np.float32)
        _gated(gate_up.numpy(), activation == "gelu_tanh", out)
        return torch.from_numpy(out)
    gate, up = gate_up[:, :n], gate_up[:, n:]
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return act * up


def stacked(x: torch.Tensor, *ws) -> torch.Tensor:
    """x times the matrices `ws`, side by side (T, sum of their rows): one product where they are the
    parts of one stacked packed matrix, in order and all of it; else each product, joined."""
    whole = getattr(ws[0], "whole", None)
    if whole is not None and all(getattr(w, "whole", None) is whole for w in ws) and ws[0].lo == 0 and \
            ws[-1].hi == whole.shape[0] and all(a.hi == b.lo for a, b in zip(ws, ws[1:])):
        return whole.matmul(x)
    return torch.cat(linears(x, *ws), dim=1)


F32_GEMV = ("numba", "torch")


def gemv_f32(x: torch.Tensor, w: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """One float32 row x (1, in) times w (out, in) on the CPU: numba's streaming loop or torch's
    F.linear, whichever this machine measured faster for this shape (choice.py), or `path`."""
    path = path or choose(f"f32 GEMV {w.shape[0]}x{w.shape[1]}", {
        "numba": lambda: gemv_f32(x, w, "numba"), "torch": lambda: F.linear(x, w)})
    if path == "torch":
        return F.linear(x, w)
    out = torch.empty(1, w.shape[0], dtype=torch.float32)
    _gemm_few_f32(w.numpy(), x.reshape(1, -1).contiguous().numpy(), out.numpy(), SLOTS)
    return out


FEW_ROWS = 8  # up to this many float32 rows: gemm_few_f32 (decode steps of a batch, n choices)


def gemm_few_f32(x: torch.Tensor, w: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """A few float32 rows x (M <= FEW_ROWS, in) times w (out, in) on the CPU: numba's loop reading w
    once for every row, or torch's F.linear, whichever this machine measured faster for the shape."""
    path = path or choose(f"f32 GEMM {x.shape[0]}x{w.shape[0]}x{w.shape[1]}", {
        "numba": lambda: gemm_few_f32(x, w, "numba"), "torch": lambda: F.linear(x, w)})
    if path == "torch":
        return F.linear(x, w)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    _gemm_few_f32(w.numpy(), x.contiguous().numpy(), out.numpy(), SLOTS)
    return out


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for x (T, in), w (out, in) float or packed. A few CPU float32 rows: gemv_f32 (one) or
    gemm_few_f32."""
    if isinstance(w, (PackedWeight, PackedPart)):
        return w.matmul(x)
    if x.shape[0] <= FEW_ROWS and x.device.type == "cpu" and x.dtype == torch.float32 and \
            w.dtype == torch.float32 and w.is_contiguous():
        return gemv_f32(x, w) if x.shape[0] == 1 else gemm_few_f32(x, w)
    return F.linear(x, w)


def linears(x: torch.Tensor, *ws) -> tuple[torch.Tensor, ...]:
    """linear(x, w) for matrices sharing the input x; the parts of one stacked packed matrix run as
    one product (each part is a column range of it), whatever else is among them."""
    wholes: dict[int, torch.Tensor] = {}
    out = []
    for w in ws:
        if isinstance(w, PackedPart):
            if id(w.whole) not in wholes:
                wholes[id(w.whole)] = w.whole.matmul(x)
            out.append(wholes[id(w.whole)][:, w.lo:w.hi])
        else:
            out.append(linear(x, w))
    return tuple(out)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows of the embedding table: float, or anything that gathers its own rows (packed codes, a
    GGUF's blocks)."""
    if not isinstance(w, torch.Tensor):
        return w.rows(ids.to(w.device))
    return F.embedding(ids, w)


jitcache.tie(globals(), scalars, jitcache, workshare)  # inlines scalars' exp; compiled with its FASTMATH
