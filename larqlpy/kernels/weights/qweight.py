"""Packed weight matrices: bf16, and 8- or 4-bit integer codes in groups, with the kernels that use them.

A code u of one output row stands for  scale * (u - zero)  (+ minimum in affine formats), with one
float32 scale (and minimum) per group of `group` consecutive inputs:
  int8 (ours)  u in 1..255, zero 128, group 32: symmetric, scale = max|w| / 127 (Q8_0's grid);  8.5 bits
  int4 (ours)  u in 0..15, zero 0, affine, group 32 (Q4_1's grid);                               5 bits
  native       what the GGUF held, exactly (model/native.py), at its own width: Q8_0 as 8-bit codes,
               Q5_0, Q5_1 and Q5_K as 5-bit, Q6_K as 6-bit (in groups of 16), Q4_K, Q4_1 and
               Q4_0 as 4-bit (`narrow`: a matrix stacked with another of a wider type takes its width);
               Q2_K as 2-bit, Q3_K as 3-bit in groups of 16, IQ4_NL, IQ4_XS and MXFP4 as their 4-bit
               indices into their table of codes (kinds "iq4", "fp4": simd.TABLES);
               IQ3_S, IQ1_S as 5-bit, IQ3_XXS, IQ1_M as 6-bit, IQ2_* as 8-bit (gguf_grid.py)
  bf16         the top 16 bits of the float32 (round to nearest even);              16 bits per weight
Both formulas round once per operation in float32, as gguf-py's dequantization does, so a GGUF's
codes come back as the values it dequantizes to, bit for bit. Scales and minimums are float16
(2 bytes per group) where every value of a matrix is a float16 exactly, as a GGUF's d and m are and
our int8 and int4 make theirs; a K-quant's d * sc, never a float16, is held as the file holds it
(int8 sc per group -- Q2_K's 4-bit sc and m in one byte --, float16 d per 256 weights: `outer`), and
MXFP4's power-of-two scales as the file's exponent bytes (uint8, 2^(e - 128): codebytes.EXPONENTS), else
float32.

Layout: output rows in tiles of TILE. Integer codes are stored per tile input-unit-major,
(tiles, k/4, TILE, 4) for 8-bit, (tiles, k/8, TILE, 4) for 4-bit (byte i of a row's word: inputs
8o+i in the low nibble, 8o+4+i in the high) and (tiles, k/16, TILE, 4) for 2-bit (byte i: inputs
16o+4s+i at bits 2s): the four inputs one integer dot-product instruction sums sit side by side for
each row (qdot.py, simd.py). 5- and 6-bit codes: (tiles, k/8, TILE + 16 P, 4), the 4-bit layout of
their low four bits, then P = 1 or 2 x TILE bytes of their high bits: a 32-bit word per row for every
4 / P octets, each byte holding its inputs' high bits in P-bit fields that a shift and a mask move
beside the nibbles (simd.high_at); 3-bit codes likewise, the 2-bit layout and (tiles, k/16, TILE + 32,
4). bf16: (tiles, k, TILE).

On the CPU integer codes run the qdot kernels (int8 activations, integer dot products) for any number
of activation rows. bf16, the float path and CUDA dequantize a slab of tiles at a time into float32
for torch's GEMM beyond a few rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from larqlpy.errors import LarqlError
from larqlpy.kernels import cpu
from larqlpy.kernels.weights import dequant, qdot, simd
from larqlpy.kernels.weights.codebytes import E8M0
from larqlpy.kernels.weights.packing import GROUP, round_codes, search_int4, tile_codes, tile_groups, to_half
from larqlpy.kernels.weights.qdot import NO_OUTER, NO_TABLE
from larqlpy.kernels.weights.simd import ROWS as TILE

FORMATS = ("f32", "bf16", "int8", "int4", "native")
SLAB_BYTES = 16 << 20  # float32 scratch per dequantized slab in prefill
PACK_VERSION = 9  # bump when packing changes what a format's codes are (9: MXFP4 as "fp4" indices)
GEMV_ROWS = 16  # bf16 / float path: up to this many rows run a GEMV, faster there than a slab
NO_MINIMUM = np.zeros((0, 1, TILE), np.float32)


def check_format(name: str, param: str = "weights") -> str:
    if name not in FORMATS:
        raise LarqlError(f"`{param}`: expected one of {', '.join(FORMATS)}, got {name!r}")
    return name


def _halves_if_exact(scale: np.ndarray, minimum: np.ndarray | None):
    """Scales (and minimums) as float16 bits (uint16) when every value is a float16 exactly (a GGUF's
    own d and m; our int8 / int4 round theirs to float16 when packing), else float32 as they are."""
    parts = [scale] + ([] if minimum is None else [minimum])
    with np.errstate(over="ignore"):  # a value past float16's range is no float16: not exact
        exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in parts)
    if exact:
        parts = [a.astype(np.float16).view(np.uint16) for a in parts]
    return parts[0], (None if minimum is None else parts[1])


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    if a is None:
        return None
    return torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a)  # float16 bits, held as int16


def _float_values(a: torch.Tensor, blocks: torch.Tensor | None, which: int) -> torch.Tensor:
    """Scales (which 0) or minimums (1) as float32, from how they are held: float32, float16 bits, or a
    K-quant's integers (uint8: Q2_K's scale and minimum in one byte's nibbles, qdot.sub_value) times
    their blocks' float16 d (or -dmin) `blocks` gathered alike (exact in float32), or (uint8 without
    blocks) exponent bytes e, 2^(e - 128)."""
    if blocks is not None:
        ints = (a >> (4 * which)) & 15 if a.dtype == torch.uint8 else a
        return blocks.view(torch.float16).float() * ints.float()
    if a.dtype == torch.uint8:
        return torch.from_numpy(E8M0).to(a.device)[a.long()]
    return a.view(torch.float16).float() if a.dtype == torch.int16 else a


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint16) if t.dtype == torch.int16 else t.numpy()  # the kernels read uint16 as float16


class PackedWeight:
    """An (out, in) weight matrix held as bf16 or integer codes in the tiled layout above.

    kind: "bf16", "f16" (a GGUF's float16 matrix as it is), "u8", "u6", "u5", "u4", "u3", "u2", or a
    table's name (simd.TABLES: 4-bit indices into its codes); zero, group: the code's zero point and the
    inputs per scale; lowest, highest: the range of codes (a table's indices) present (which kernel
    paths may take it); outer: a K-quant's blocks' float16 d and -dmin (tiles, blocks, 2, TILE), beside
    int8 scale and minimum holding the file's sub-block integers (qdot.group_value; Q2_K's: one uint8
    array for both, its nibbles)."""

    def __init__(self, kind: str, shape: tuple[int, int], codes: torch.Tensor, scale: torch.Tensor | None = None,
                 minimum: torch.Tensor | None = None, zero: int = 0, group: int = GROUP,
                 lowest: int = 0, highest: int = 255, outer: torch.Tensor | None = None):
        self.kind, self.shape, self.zero, self.group = kind, tuple(shape), int(zero), int(group)
        self.codes, self.scale, self.minimum, self.outer = codes, scale, minimum, outer
        self.lowest, self.highest = int(lowest), int(highest)
        self.bits = {**{f"u{b}": b for b in (8, 6, 5, 4, 3, 2)}, **{t: 4 for t in simd.TABLES}}.get(kind, 16)
        self.half = kind == "f16"  # float16 as a GGUF holds it; bf16 otherwise where bits == 16
        self.table = simd.TABLES.get(kind, NO_TABLE)  # the codes a table's indices stand for
        self.width = kind if kind in simd.TABLES else self.bits  # the kernels' key (qdot.gemm)
        self.path = "float" if self.bits == 16 else cpu.int_path(8, int(self.table.min()), int(self.table.max())) \
            if self.table.size else cpu.int_path(self.bits, self.lowest, self.highest)
        self.ahead = 0  # bytes the CPU kernels prefetch ahead of the codes or rows (prefetch.py sets it)
        # numpy views for the numba kernels, made once: decode calls them for every matrix of every token
        self.arrays = () if codes.device.type != "cpu" else (codes.numpy(),) if self.bits == 16 else \
            (codes.numpy(), _numpy(scale), NO_MINIMUM if minimum is None else _numpy(minimum),
             NO_OUTER if outer is None else _numpy(outer))

    @classmethod
    def from_codes(cls, u: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, zero: int,
                   bits: int) -> "PackedWeight":
        """Row-major codes u (out, in) uint8 and per-group scale (and minimum) (out, groups), tiled;
        bits: a width, or a table's name (u its indices)."""
        n, k = u.shape
        lowest, highest = (int(u.min()), int(u.max())) if u.size else (0, 0)
        pad = -n % TILE  # whole tiles: zero rows (code = zero, scale 0), cut back from outputs

        def groups(a):
            return None if a is None else tile_groups(np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]))

        tiled = tile_codes(u, simd.layout_bits(bits), 0 if bits in simd.TABLES else zero)
        return cls.from_tiled(tiled, (n, k), groups(scale), groups(minimum), zero, bits, lowest, highest)

    @classmethod
    def from_tiled(cls, codes: np.ndarray, shape: tuple[int, int], scale: np.ndarray, minimum: np.ndarray | None,
                   zero: int, bits: int, lowest: int, highest: int, halves: bool = False,
                   outer: np.ndarray | None = None) -> "PackedWeight":
        """Codes and per-group scales (and minimums) already tiled -- (tiles, groups, TILE), the last
        tile's padding rows holding the zero code and scale 0 -- and the range of codes present.
        halves: every scale and minimum is a float16 value (a GGUF's own d and m): held as its bits
        without the check `_halves_if_exact` makes. outer: a K-quant's blocks' d and -dmin as float16
        bits, scale and minimum its int8 sub-block values, held as they are. uint8 scales and no outer:
        exponent bytes (gguf_blocks.EXPONENT), held so by a table of codebytes.EXPONENTS, else as values."""
        if outer is None and scale.dtype == np.uint8 and bits not in simd.EXPONENTS:
            scale = E8M0[scale]  # the kernels read uint8 scales as exponents on those tables only
        if outer is None and scale.dtype != np.uint8:
            scale, minimum = ([a.astype(np.float16).view(np.uint16) for a in (scale, minimum)] if halves and
                              minimum is not None else (scale.astype(np.float16).view(np.uint16), None) if halves
                              else _halves_if_exact(scale, minimum))
        kind = bits if bits in simd.TABLES else f"u{bits}"
        return cls(kind, shape, torch.from_numpy(codes), _tensor(scale), _tensor(minimum), zero,
                   shape[1] // scale.shape[1], lowest, highest, _tensor(outer))

    @classmethod
    def from_16bit(cls, bits: np.ndarray, kind: str) -> "PackedWeight":
        """A row-major (out, in) matrix of float16 or bfloat16 bits (kind "f16" / "bf16"), tiled as they
        are: the file's own values, no rounding; padding rows zero."""
        n, k = bits.shape
        nt = -(-n // TILE)
        tiles = np.zeros((nt * TILE, k), np.int16)
        tiles[:n] = bits.view(np.int16)
        return cls(kind, (n, k), torch.from_numpy(np.ascontiguousarray(tiles.reshape(nt, TILE, k).transpose(0, 2, 1))))

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str, name: str = "weight") -> "PackedWeight":
        n, k = w.shape
        if fmt in ("int8", "int4") and k % GROUP:
            raise LarqlError(f"`weights` {fmt}: {name} has {k} inputs, not a multiple of the group size {GROUP}")
        w = w.detach().to("cpu", torch.float32).contiguous()
        if fmt == "bf16":
            nt = -(-n // TILE)
            if nt * TILE != n:
                w = torch.cat([w, w.new_zeros(nt * TILE - n, k)])
            top = w.to(torch.bfloat16).view(torch.int16).view(nt, TILE, k)  # round to nearest even
            return cls("bf16", (n, k), top.transpose(1, 2).contiguous())
        wn, u = w.numpy(), np.empty((n, k), np.uint8)
        if fmt == "int8":  # Q8_0's grid: max|w| / 127 per group, held as float16
            scale = to_half(np.abs(wn.reshape(n, -1, GROUP)).max(-1) / np.float32(127.0))
            round_codes(wn, scale, np.zeros((0, 1), np.float32), 128, 255, u)
            return cls.from_codes(u, scale, None, 128, 8)
        if fmt == "int4":  # Q4_1's grid: affine, float16 scale and minimum
            scale, minimum = np.empty((n, k // GROUP), np.float32), np.empty((n, k // GROUP), np.float32)
            search_int4(wn, scale, minimum)
            scale, minimum = to_half(scale), to_half(minimum)
            round_codes(wn, scale, minimum, 0, 15, u)
            return cls.from_codes(u, scale, minimum, 0, 4)
        raise LarqlError(f"`weights`: cannot pack into {fmt!r}")

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        held = {t.data_ptr(): t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum, self.outer)
                if t is not None}  # by address: Q2_K's minimums are its scales' bytes
        return sum(held.values())

    def group_values(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's scale and minimum as float32 values (tiles, groups, TILE), however they are
        held: float32, float16 bits, or a K-quant's integers times their block's d (or -dmin)."""
        def values(a: torch.Tensor | None, which: int) -> torch.Tensor | None:
            if a is None:
                return None
            blocks = None if self.outer is None else \
                self.outer[:, :, which].repeat_interleave(a.shape[1] // self.outer.shape[1], dim=1)
            return _float_values(a, blocks, which)
        return values(self.scale, 0), values(self.minimum, 1)

    def meta(self) -> dict:
        """What describes the codes beside the tensors (the packed-weight cache's header)."""
        return {"kind": self.kind, "shape": list(self.shape), "zero": self.zero, "group": self.group,
                "lowest": self.lowest, "highest": self.highest}

    def to(self, device: torch.device) -> "PackedWeight":
        def move(t):
            return None if t is None else t.to(device)
        return PackedWeight(self.kind, self.shape, move(self.codes), move(self.scale), move(self.minimum),
                            self.zero, self.group, self.lowest, self.highest, move(self.outer))

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Float32 weight rows idx (any shape) -> idx.shape + (in,)."""
        flat = idx.reshape(-1)
        if not self.arrays:  # not on the CPU: torch ops
            return self._rows_torch(flat).view(*idx.shape, self.shape[1])
        out = np.empty((flat.numel(), self.shape[1]), np.float32)
        ids = flat.to(torch.int64).contiguous().numpy()
        if self.bits == 16:
            dequant.rows_16(self.arrays[0], ids, out, self.half)
        else:
            dequant.rows_int(*self.arrays, self.zero, self.bits, self.table, ids, out)
        return torch.from_numpy(out).view(*idx.shape, self.shape[1])

    def _rows_torch(self, idx: torch.Tensor) -> torch.Tensor:
        """The same float32 rows through torch ops (CUDA, and the CPU twin the tests compare)."""
        t, r = idx // TILE, idx % TILE
        codes = self.codes[t, :, r]  # (n, k/4 or k/8, 4) or 16-bit floats (n, k)
        if self.half:
            return codes.view(torch.float16).float()
        if self.kind == "bf16":
            return (codes.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
        low = simd.LOW[self.width]
        if low != 8:  # (n, units, parts, 4): inputs 8o+i, 8o+4+i (nibbles) or 16o+4s+i (crumbs)
            codes = torch.stack([(codes >> (low * s)) & ((1 << low) - 1) for s in range(8 // low)], dim=2)
        u = codes.reshape(len(idx), -1).to(torch.int32)
        if self.table.size:
            u = torch.from_numpy(self.table).to(device=u.device, dtype=torch.int32)[u.long()]
        if simd.PLANES[self.bits]:
            u = u | (self._high_torch(t, r) << low)
        g = torch.arange(self.shape[1], device=idx.device) // self.group

        def per_group(a: torch.Tensor, which: int) -> torch.Tensor:
            blocks = None if self.outer is None else \
                self.outer[t[:, None], g[None, :] // (a.shape[1] // self.outer.shape[1]), which, r[:, None]]
            return _float_values(a[t[:, None], g[None, :], r[:, None]], blocks, which)

        v = per_group(self.scale, 0) * (u - self.zero).float()
        return v if self.minimum is None else v + per_group(self.minimum, 1)

    def _high_torch(self, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Rows (t, r)'s codes' bits above the nibbles (crumbs), (n, k) int32, from their high words
        (simd.high_at)."""
        p, n = simd.PLANES[self.bits], simd.parts(self.bits)
        per = 8 // (p * n)
        slots = TILE // per
        o = torch.arange(self.codes.shape[1], device=t.device)
        area = (o // per * per)[None, :] + (r // slots)[:, None]  # (n, units): the unit holding the word
        words = self.codes[t[:, None], area, (TILE + r % slots)[:, None]].to(torch.int32)  # (n, units, 4)
        field = n * (o % per)[:, None] + torch.arange(n, device=t.device)[None, :]  # (units, parts)
        high = (words[:, :, None, :] >> (field * p)[None, :, :, None]) & ((1 << p) - 1)  # (n, units, parts, 4)
        return high.reshape(len(t), -1)

    def _slab(self, t0: int, t1: int) -> torch.Tensor:
        """Tiles [t0, t1) dequantized input-major, (in, rows): the GEMM reads it transposed, no copy."""
        slab = torch.empty(self.shape[1], (t1 - t0) * TILE)
        if self.bits == 16:
            dequant.slab_16(self.arrays[0], t0, t1, slab.numpy(), self.half)
        else:
            dequant.slab_int(*self.arrays, self.zero, self.bits, self.table, t0, t1, slab.numpy())
        return slab

    def matmul(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out) on the CPU's integer kernels (`path`, default the fastest this CPU
        runs for these codes) for any T: each row's numbers are the same whatever T, so a prefill
        in chunks and decode one token at a time agree. bf16 and the float path run a GEMV for a
        few rows and torch's GEMM over dequantized slabs beyond; so does every device but the CPU."""
        path = path or self.path
        rows = x.shape[0]
        if self.arrays and (path != "float" or rows <= GEMV_ROWS):
            f32 = x.dtype == torch.float32
            xs = (x if f32 and x.is_contiguous() else x.float().contiguous()).numpy()
            out = np.empty((rows, self.codes.shape[0] * TILE), np.float32)
            if self.bits == 16:
                for i in range(rows):
                    dequant.gemv_16(self.arrays[0], xs[i], out[i], self.ahead, self.half)
            else:
                qdot.gemm(*self.arrays, self.zero, self.width, xs, path, out, self.ahead)
            y = torch.from_numpy(out if out.shape[1] == self.shape[0] else out[:, :self.shape[0]])
            return y if f32 else y.to(x.dtype)
        n, k = self.shape
        tiles = max(1, SLAB_BYTES // (4 * k * TILE))
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        for t0 in range(0, self.codes.shape[0], tiles):
            t1 = min(self.codes.shape[0], t0 + tiles)
            lo, hi = t0 * TILE, min(n, t1 * TILE)
            if self.arrays:
                out[:, lo:hi] = torch.mm(x, self._slab(t0, t1)[:, :hi - lo].to(x.dtype))
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

