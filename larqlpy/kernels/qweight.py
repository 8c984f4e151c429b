"""Weight-only low-bit matrices: bf16, int8 and int4, and the kernels that multiply by them.

Formats (value of one weight; groups are GROUP consecutive inputs of one output row):
  bf16  the top 16 bits of the float32 (round to nearest even, held as int16); 16 bits
  int8  q * scale, q in [-127, 127], one float32 scale per group;      9 bits per weight
  int4  q * scale + minimum, q in [0, 15], float32 scale and minimum;  6 bits per weight
int4 is affine, not symmetric: the GGUF this project converts stores most of its 4-bit tensors
(Q4_K) as affine groups of 32, so this grid can hold those values again.

Layout: output rows in tiles of TILE; inside a tile the codes are input-major, (tiles, inputs, TILE),
so a tile's rows sit side by side. Decode multiplies one activation row by every matrix; a
per-row dot product over a 32-value group is too short for the compiler to vectorise, but this
layout makes every inner loop run across TILE rows (8 lanes per AVX2 instruction) and reads each
packed byte exactly once per token. int4 keeps inputs 2i and 2i+1 in one byte (low, high nibble).

Decode (one row on the CPU) runs the numba GEMV kernels on the codes. Everything else (prefill,
CUDA) dequantizes a slab of tiles at a time and calls torch's GEMM: numba on the CPU, torch on
other devices, both computing q * scale (+ minimum) in float32 without fused multiply-adds, so both
produce the same float32 weights bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from larqlpy.errors import LarqlError

TILE = 64
GROUP = 32
FORMATS = ("f32", "bf16", "int8", "int4")
SLAB_BYTES = 16 << 20  # float32 scratch per dequantized slab in prefill
PACK_VERSION = 1  # bump when packing changes what a format's codes are: cached packs are rebuilt
GEMV_ROWS = 16  # up to this many rows run the decode kernel once per row: faster than a slab (measured on the 270M shapes)


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise LarqlError(f"`weights`: expected one of {', '.join(FORMATS)}, got {name!r}")
    return name


# --- quantization (load time, CPU) -------------------------------------------------------------

@njit(parallel=True, cache=True, error_model="numpy")
def _quant_int8(w, q, scale):  # pragma: no cover - jitted
    n, k = w.shape
    for i in prange(n):
        t, r = i // q.shape[2], i % q.shape[2]
        for g in range(k // GROUP):
            amax = np.float32(0.0)
            for j in range(g * GROUP, (g + 1) * GROUP):
                amax = max(amax, abs(w[i, j]))
            s = amax / np.float32(127.0)
            scale[t, g, r] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(g * GROUP, (g + 1) * GROUP):
                q[t, j, r] = np.int8(min(127.0, max(-127.0, np.rint(w[i, j] * inv))))


@njit(parallel=True, cache=True, error_model="numpy")
def _quant_int4(w, packed, scale, minimum):  # pragma: no cover - jitted
    n, k = w.shape
    levels = np.empty((n, GROUP), np.uint8)
    for i in prange(n):
        t, r = i // packed.shape[2], i % packed.shape[2]
        qs = levels[i]
        for g in range(k // GROUP):
            lo, hi = w[i, g * GROUP], w[i, g * GROUP]
            for j in range(g * GROUP, (g + 1) * GROUP):
                lo = min(lo, w[i, j])
                hi = max(hi, w[i, j])
            # Round to nearest on the min..max grid, trying a few step counts: a group whose values
            # came from an affine 4-bit grid that never used its top level (common in Q4_K data)
            # is reproduced exactly by the step count it was written with.
            best_err, best_s = np.inf, np.float32(0.0)
            for steps in range(15, 10, -1):
                s = np.float32((hi - lo) / np.float32(steps))
                inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
                err = 0.0
                for j in range(g * GROUP, (g + 1) * GROUP):
                    qv = min(15.0, np.rint((w[i, j] - lo) * inv))
                    d = np.float32(qv) * s + lo - w[i, j]
                    err += d * d
                if err < best_err:
                    best_err, best_s = err, s
            scale[t, g, r] = best_s
            minimum[t, g, r] = lo
            inv = np.float32(1.0) / best_s if best_s > 0 else np.float32(0.0)
            for j in range(GROUP):
                qs[j] = np.uint8(min(15.0, np.rint((w[i, g * GROUP + j] - lo) * inv)))
            for j in range(GROUP // 2):
                packed[t, (g * GROUP) // 2 + j, r] = qs[2 * j] | (qs[2 * j + 1] << 4)


# --- decode: one activation row times the codes (CPU) -------------------------------------------

@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gemv_int8(q, scale, x, out):  # pragma: no cover - jitted
    nt, k, tn = q.shape
    for t in prange(nt):
        acc = np.zeros(tn, np.float32)
        s = np.empty(tn, np.float32)
        for g in range(k // GROUP):
            s[:] = 0.0
            for j in range(g * GROUP, (g + 1) * GROUP):
                xj = x[j]
                for r in range(tn):
                    s[r] += np.float32(q[t, j, r]) * xj
            for r in range(tn):
                acc[r] += scale[t, g, r] * s[r]
        out[t * tn:(t + 1) * tn] = acc


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gemv_int4(packed, scale, minimum, x, out):  # pragma: no cover - jitted
    nt, kh, tn = packed.shape
    ng = scale.shape[1]
    xsum = np.zeros(ng, np.float32)
    for g in range(ng):
        for j in range(g * GROUP, (g + 1) * GROUP):
            xsum[g] += x[j]
    for t in prange(nt):
        acc = np.zeros(tn, np.float32)
        s = np.empty(tn, np.float32)
        for g in range(ng):
            s[:] = 0.0
            for p in range(g * GROUP // 2, (g + 1) * GROUP // 2):
                # b = lo + 16 hi, so lo*x0 + hi*x1 = b*x0 + hi*(x1 - 16 x0). The float -> int32 -> float
                # round trip extracts hi in 32-bit lanes (integer ops would widen to 64-bit lanes).
                x0 = x[2 * p]
                xd = x[2 * p + 1] - np.float32(16.0) * x0
                for r in range(tn):
                    b = np.float32(packed[t, p, r])
                    hi = np.float32(np.int32(b * np.float32(0.0625)))
                    s[r] += b * x0 + hi * xd
            for r in range(tn):
                acc[r] += scale[t, g, r] * s[r] + minimum[t, g, r] * xsum[g]
        out[t * tn:(t + 1) * tn] = acc


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gemv_bf16(w, x, out):  # pragma: no cover - jitted
    nt, k, tn = w.shape
    for t in prange(nt):
        acc = np.zeros(tn, np.float32)
        bits = np.empty(tn, np.uint32)
        vals = bits.view(np.float32)
        for j in range(k):
            xj = x[j]
            for r in range(tn):
                bits[r] = np.uint32(w[t, j, r]) << np.uint32(16)
            for r in range(tn):
                acc[r] += vals[r] * xj
        out[t * tn:(t + 1) * tn] = acc


# --- dequantization into float32 rows (prefill slabs, embedding lookups) -----------------------
# No fastmath: q * scale + minimum must round as two operations, as torch computes it.

@njit(parallel=True, cache=True, error_model="numpy")
def _rows_int8(q, scale, idx, out):  # pragma: no cover - jitted
    tn = q.shape[2]
    for n in prange(idx.shape[0]):
        t, r = idx[n] // tn, idx[n] % tn
        for j in range(q.shape[1]):
            out[n, j] = np.float32(q[t, j, r]) * scale[t, j // GROUP, r]


@njit(parallel=True, cache=True, error_model="numpy")
def _rows_int4(packed, scale, minimum, idx, out):  # pragma: no cover - jitted
    tn = packed.shape[2]
    for n in prange(idx.shape[0]):
        t, r = idx[n] // tn, idx[n] % tn
        for p in range(packed.shape[1]):
            b = packed[t, p, r]
            g = (2 * p) // GROUP
            out[n, 2 * p] = np.float32(b & 15) * scale[t, g, r] + minimum[t, g, r]
            out[n, 2 * p + 1] = np.float32(b >> 4) * scale[t, g, r] + minimum[t, g, r]


@njit(parallel=True, cache=True, error_model="numpy")
def _rows_bf16(w, idx, out):  # pragma: no cover - jitted
    tn = w.shape[2]
    bits = out.view(np.uint32)
    for n in prange(idx.shape[0]):
        t, r = idx[n] // tn, idx[n] % tn
        for j in range(w.shape[1]):
            bits[n, j] = np.uint32(w[t, j, r]) << np.uint32(16)


@njit(parallel=True, cache=True, error_model="numpy")
def _slab_int8(q, scale, t0, t1, out):  # pragma: no cover - jitted
    tn = q.shape[2]
    for t in prange(t0, t1):
        c = (t - t0) * tn
        for j in range(q.shape[1]):
            g = j // GROUP
            for r in range(tn):
                out[j, c + r] = np.float32(q[t, j, r]) * scale[t, g, r]


@njit(parallel=True, cache=True, error_model="numpy")
def _slab_int4(packed, scale, minimum, t0, t1, out):  # pragma: no cover - jitted
    tn = packed.shape[2]
    for t in prange(t0, t1):
        c = (t - t0) * tn
        for p in range(packed.shape[1]):
            g = (2 * p) // GROUP
            for r in range(tn):
                b = np.float32(packed[t, p, r])
                hi = np.float32(np.int32(b * np.float32(0.0625)))  # exact: b is an integer below 256
                out[2 * p, c + r] = (b - np.float32(16.0) * hi) * scale[t, g, r] + minimum[t, g, r]
                out[2 * p + 1, c + r] = hi * scale[t, g, r] + minimum[t, g, r]


@njit(parallel=True, cache=True, error_model="numpy")
def _slab_bf16(w, t0, t1, out):  # pragma: no cover - jitted
    tn = w.shape[2]
    bits = out.view(np.uint32)
    for t in prange(t0, t1):
        c = (t - t0) * tn
        for j in range(w.shape[1]):
            for r in range(tn):
                bits[j, c + r] = np.uint32(np.uint16(w[t, j, r])) << np.uint32(16)


GEMV = {"int4": _gemv_int4, "int8": _gemv_int8, "bf16": _gemv_bf16}
ROWS = {"int4": _rows_int4, "int8": _rows_int8, "bf16": _rows_bf16}
SLAB = {"int4": _slab_int4, "int8": _slab_int8, "bf16": _slab_bf16}


class PackedWeight:
    """A (out, in) weight matrix held as low-bit codes in the tiled layout above."""

    def __init__(self, fmt: str, shape: tuple[int, int], codes: torch.Tensor, scale: torch.Tensor | None = None,
                 minimum: torch.Tensor | None = None):
        self.fmt, self.shape = fmt, shape
        self.codes, self.scale, self.minimum = codes, scale, minimum
        # numpy views for the numba kernels, made once: decode calls them ~130 times per token
        arrays = [t for t in (codes, scale, minimum) if t is not None]
        self.arrays = tuple(t.numpy() for t in arrays) if codes.device.type == "cpu" else ()

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str, name: str = "weight") -> "PackedWeight":
        n, k = w.shape
        if fmt in ("int8", "int4") and k % GROUP:
            raise LarqlError(f"`weights` {fmt}: {name} has {k} inputs, not a multiple of the group size {GROUP}")
        w = w.detach().to("cpu", torch.float32).contiguous()
        nt = -(-n // TILE)
        if nt * TILE != n:  # pad to whole tiles with zero rows; outputs are cut back to n
            w = torch.cat([w, w.new_zeros(nt * TILE - n, k)])
        wn = w.numpy()
        if fmt == "bf16":
            top = w.to(torch.bfloat16).view(torch.int16).view(nt, TILE, k)  # round to nearest even
            return cls(fmt, (n, k), top.transpose(1, 2).contiguous())
        scale = torch.empty(nt, k // GROUP, TILE)
        if fmt == "int8":
            codes = torch.empty(nt, k, TILE, dtype=torch.int8)
            _quant_int8(wn, codes.numpy(), scale.numpy())
            return cls(fmt, (n, k), codes, scale)
        if fmt == "int4":
            codes, minimum = torch.empty(nt, k // 2, TILE, dtype=torch.uint8), torch.empty(nt, k // GROUP, TILE)
            _quant_int4(wn, codes.numpy(), scale.numpy(), minimum.numpy())
            return cls(fmt, (n, k), codes, scale, minimum)
        raise LarqlError(f"`weights`: cannot pack into {fmt!r}")

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum) if t is not None)

    def to(self, device: torch.device) -> "PackedWeight":
        move = (lambda t: None if t is None else t.to(device))
        return PackedWeight(self.fmt, self.shape, move(self.codes), move(self.scale), move(self.minimum))

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Float32 weight rows idx (any shape) -> idx.shape + (in,)."""
        flat = idx.reshape(-1)
        if not self.arrays:  # not on the CPU: torch ops
            return self._rows_torch(flat).view(*idx.shape, self.shape[1])
        out = np.empty((flat.numel(), self.shape[1]), np.float32)
        ROWS[self.fmt](*self.arrays, flat.to(torch.int64).contiguous().numpy(), out)
        return torch.from_numpy(out).view(*idx.shape, self.shape[1])

    def _rows_torch(self, idx: torch.Tensor) -> torch.Tensor:
        """The same float32 rows through torch ops (CUDA, and the CPU twin the tests compare)."""
        t, r = idx // TILE, idx % TILE
        codes = self.codes[t, :, r]  # (n, in) or (n, in/2)
        if self.fmt == "bf16":
            return (codes.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
        g = torch.arange(self.shape[1], device=idx.device) // GROUP
        scale = self.scale[t[:, None], g[None, :], r[:, None]]
        if self.fmt == "int8":
            return codes.float() * scale
        q = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(len(idx), -1).float()
        return q * scale + self.minimum[t[:, None], g[None, :], r[:, None]]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out): the GEMV kernel per row for a few CPU rows, else GEMM over dequantized slabs."""
        if x.shape[0] <= GEMV_ROWS and self.arrays:  # a few rows: re-reading the codes beats dequantizing
            xs = x.float().contiguous().numpy()
            out = np.empty((x.shape[0], self.codes.shape[0] * TILE), np.float32)
            for i in range(x.shape[0]):
                GEMV[self.fmt](*self.arrays, xs[i], out[i])
            return torch.from_numpy(out[:, :self.shape[0]]).to(x.dtype)
        n, k = self.shape
        tiles = max(1, SLAB_BYTES // (4 * k * TILE))
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for t0 in range(0, self.codes.shape[0], tiles):
            t1 = min(self.codes.shape[0], t0 + tiles)
            lo, hi = t0 * TILE, min(n, t1 * TILE)
            if self.arrays:  # (in, rows) straight from the tiles: the GEMM reads it transposed, no copy
                slab = torch.empty(k, (t1 - t0) * TILE)
                SLAB[self.fmt](*self.arrays, t0, t1, slab.numpy())
                out[:, lo:hi] = torch.mm(x, slab[:, :hi - lo].to(x.dtype))
            else:
                out[:, lo:hi] = F.linear(x, self.rows(torch.arange(lo, hi, device=self.device)).to(x.dtype))
        return out


class PackedPart:
    """Rows [lo, hi) of a PackedWeight that stacks matrices reading the same input (q|k|v, gate|up):
    `linears` multiplies them in one kernel call, which decode's per-call overhead rewards."""

    def __init__(self, whole: PackedWeight, lo: int, hi: int):
        self.whole, self.lo, self.hi = whole, lo, hi
        self.shape = (hi - lo, whole.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole.matmul(x)[:, self.lo:self.hi]

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.whole.rows(idx + self.lo)

    @property
    def device(self) -> torch.device:
        return self.whole.device


def stack(ws: list[torch.Tensor], fmt: str, name: str) -> list[PackedPart]:
    """Pack several (out_i, in) matrices as one; returns a part per matrix (codes are per row, so each
    part holds exactly what packing it alone would)."""
    whole = PackedWeight.quantize(torch.cat([w.float() for w in ws]), fmt, name)
    bounds = np.cumsum([0] + [w.shape[0] for w in ws])
    return [PackedPart(whole, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
