"""A GGUF matrix's quantized blocks taken apart into integer codes, straight from the block bytes:
what `weights` native runs when it loads a .gguf file directly.

The result is convert/native.py's, code for code (tests/test_gguf_file.py holds them equal on random
blocks of every type and on the shipped files): codes u (out, in) uint8, one float32 scale (and
minimum) per group, the zero point and the code width of kernels/weights/qweight.py, such that
scale * (u - zero) (+ minimum), rounded one operation at a time in float32, is gguf-py's dequantized
value. convert/native.py reads the codes by probing gguf-py's dequantizer (slow, and the reference);
these loops read the bits as ggml's block layouts lay them out, fast enough to unpack at load.
Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 (gguf_lowbit.py) and the IQ1-IQ3 grid types (gguf_grid.py) have
no probe there: tests/test_gguf_quants.py holds their values against gguf-py's dequantizer itself.

numba reads the float16 fields (d, dmin, m) from the block bytes, unpacks the bits and multiplies
the K-quants' sub-block scales in, as gguf-py does: (d * sc) first. One decoder of a block serves both
outputs: row-major codes (`unpack`, what the tests hold against the probes) and the tiled layout the
kernels read (`unpack_tiled`: written in place, rows anywhere in a stacked matrix, no row-major copy).
The tiled layout keeps a K-quant's scales as the file does (`TWO_LEVEL`): its integer sub-block
scales, and each block's d and -dmin apart.
"""

from __future__ import annotations

import mmap
from types import FunctionType, ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numba import njit, prange

from larqlpy.kernels import jitcache
from larqlpy.kernels.weights import gguf_first, gguf_grid, gguf_lowbit, qdot, tiled_put
from larqlpy.kernels.weights.packing import code_shape
from larqlpy.kernels.weights.qdot import NO_OUTER, NO_TABLE
from larqlpy.kernels.weights.simd import ROWS as TILE
from larqlpy.kernels.weights.simd import TABLES
from larqlpy.kernels.weights.tiled_put import put

# type name -> (block bytes, values per block, code bits, group, zero, affine)
LAYOUTS = {
    "Q8_0": (34, 32, 8, 32, 128, False), "Q5_0": (22, 32, 8, 32, 128, False), "Q4_0": (18, 32, 4, 32, 8, False),
    "Q4_1": (20, 32, 4, 32, 0, True), "Q5_1": (24, 32, 8, 32, 0, True),
    "Q4_K": (144, 256, 4, 32, 0, True), "Q5_K": (176, 256, 8, 32, 0, True), "Q6_K": (210, 256, 8, 16, 128, False),
    # gguf_lowbit.py's, from kind gguf_lowbit.FIRST on
    "Q2_K": (84, 256, 4, 16, 0, True), "Q3_K": (110, 256, 4, 16, 4, False), "IQ4_NL": (18, 32, 8, 32, 128, False),
    "IQ4_XS": (136, 256, 8, 32, 128, False), "MXFP4": (17, 32, 8, 32, 128, False),
    # gguf_grid.py's, from kind gguf_grid.FIRST on: sign * grid value + 128
    "IQ3_S": (110, 256, 8, 32, 128, False), "IQ3_XXS": (98, 256, 8, 32, 128, False),
    "IQ2_XXS": (66, 256, 8, 32, 128, False), "IQ2_XS": (74, 256, 8, 16, 128, False),
    "IQ2_S": (82, 256, 8, 16, 128, False), "IQ1_S": (50, 256, 8, 32, 128, False), "IQ1_M": (56, 256, 8, 16, 128, False),
}
KIND = {name: i for i, name in enumerate(LAYOUTS)}
assert KIND["Q2_K"] == gguf_lowbit.FIRST and KIND["IQ3_S"] == gguf_grid.FIRST
# Types whose codes above span fewer bits (2, 3, 5 or 6): (width, base), run as u - base at that width,
# zero - base (the same integers u - zero, so the same values bit for bit) -- the file's own bits.
NARROW = {"Q5_0": (5, 112), "Q5_1": (5, 0), "Q5_K": (5, 0), "Q6_K": (6, 96), "IQ3_S": (5, 112),
          "IQ3_XXS": (6, 96), "IQ1_S": (5, 112), "IQ1_M": (6, 96),  # IQ1_M: measured at 6 (docs/weights.md)
          "Q2_K": (2, 0), "Q3_K": (3, 0)}
# Types whose codes are a table's values: run as the file's 4-bit indices, looked up in the kernels (simd.TABLES)
TABLED = {"IQ4_NL": "iq4", "IQ4_XS": "iq4", "MXFP4": "fp4"}
# code -> its first index in the table (MXFP4's 0 and -0: one code, 128, index 0)
INDEX = {name: np.array([list(t).index(c) if c in t else 0 for c in range(256)], np.uint8)
         for name, t in TABLES.items()}
# Types whose group scale is held as the file's exponent byte e (uint8, 2^(e - 128): qdot.as_float,
# codebytes.exponent_floats), 0.25 bits a weight where float32 would take 1: a power of two below 2^-24
# or above 2^15 is no float16.
EXPONENT = ("MXFP4",)
# Types whose group scales are a block's float16 d times the file's integer sub-block scale: packed
# as those integers and d apart (the file's own 4.5 / 5.5 / 6.56 bits a weight, where float32 group
# scales would add 1 to 2 bits); d * sc is exact in float32, so the kernels' scale is the same value.
TWO_LEVEL = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ3_S")
# Two-level types whose 4-bit sub-block scale and minimum share a byte in the file, held so (uint8,
# scale in the low nibble): one byte per 16 weights, where a byte each would add 0.5 bits a weight
JOINT = ("Q2_K",)
# Types of 32 values a block whose scale is the block's float16 d (held as its bits, no check needed)
HALF_SCALES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL")


def packed_width(qtype: str) -> tuple[int, int]:
    """(bits, base) a matrix of this type is packed at: its table's name (base 0), its narrow width,
    else its codes' own."""
    if qtype in TABLED:
        return TABLED[qtype], 0
    return NARROW.get(qtype, (LAYOUTS[qtype][2], 0))


# What the kernels' templates (`_rows`, `_tiled`) read as globals: one family's decoders (`_kernel`).
_decode = _outer = None


def _rows(raw, kind, per, size, u, scale, minimum):  # pragma: no cover - jitted
    """Row-major: u (n, k), scale / minimum (n, groups)."""
    bpr = raw.shape[1] // size
    gpb = scale.shape[1] // bpr
    for r in prange(raw.shape[0]):
        buf = np.empty(256, np.uint8)
        sc, mn = np.zeros(16, np.float32), np.zeros(16, np.float32)
        for b in range(bpr):
            _decode(raw[r], b * size, kind, buf, sc, mn)
            u[r, b * per:(b + 1) * per] = buf[:per]
            scale[r, b * gpb:(b + 1) * gpb] = sc[:gpb]
            if minimum.shape[0]:
                minimum[r, b * gpb:(b + 1) * gpb] = mn[:gpb]


def _tiled(raw, kind, per, size, bits, base, rows, lo, codes, scale, minimum, scale8, minimum8, outer, seen,
           index, joint):  # pragma: no cover
    """Source row i to destination row lo + i of a tiled matrix (codes as words (tiles, units, TILE *
    span / 4) at `bits`, the codes less `base`, or where `index` is not empty (256) each code's
    index in its table, at 4 bits; zeroed beforehand at 3, 5 and 6 bits); scale / minimum tiled too
    (tiles, groups, TILE) float32, or, where scale8 is not empty, in scale8 / minimum8 (int8) with
    `outer` (tiles, blocks, 2, TILE): the K-quants' integer sub-block scales, their blocks' d and -dmin
    in outer (either pair empty: one signature, compiled once, serves both; joint: a sub-block's
    integer scale and minimum as one byte, in a uint8 scale8; a uint8 scale8 and no outer: MXFP4's
    exponent bytes, `_outer`'s sc); rows: the source row of each
    destination row; seen[t] = (lowest, highest) code written into tile t. A tile's rows go to one
    thread: rows of one tile share cache lines (and 3- / 5- / 6-bit rows their high words)."""
    n = rows.shape[0]
    bpr = raw.shape[1] // size
    ints = scale8.shape[0] > 0
    gpb = (scale8.shape[1] if ints else scale.shape[1]) // bpr
    t0, t1 = lo // TILE, (lo + n - 1) // TILE + 1
    for t in prange(t0, t1):
        buf = np.empty(256, np.uint8)
        words, eights = buf.view(np.uint32), buf.view(np.uint64)  # views made once: each costs a reference count
        sc, mn = np.zeros(16, np.float32), np.zeros(16, np.float32)
        low, high = 255, 0
        for dest in range(max(lo, t * TILE), min(lo + n, (t + 1) * TILE)):
            slot = dest % TILE
            row = raw[rows[dest - lo]]
            for b in range(bpr):
                _decode(row, b * size, kind, buf, sc, mn)
                for j in range(per if index.shape[0] else 0):
                    buf[j] = index[buf[j]]
                for j in range(per):
                    low, high = min(low, np.int32(buf[j]) - base), max(high, np.int32(buf[j]) - base)
                unit = 4 if bits == 8 else 8 if bits >= 4 else 16  # inputs a word of a row holds
                put(codes, t, b * per // unit, slot, words, eights, per, bits, base)
                if outer.shape[0]:  # the integers in place of the products d * sc, dmin * m
                    outer[t, b, 0, slot], outer[t, b, 1, slot] = _outer(row, b * size, kind, sc, mn)
                elif ints:  # the exponent byte in place of 2^(e - 128) (EXPONENT)
                    _outer(row, b * size, kind, sc, mn)
                for g in range(gpb):
                    if joint:  # the file's byte: scale in the low nibble, minimum in the high
                        scale8[t, b * gpb + g, slot] = np.int32(sc[g]) | (np.int32(mn[g]) << 4)
                    elif ints:
                        scale8[t, b * gpb + g, slot] = sc[g]
                        if minimum8.shape[0]:
                            minimum8[t, b * gpb + g, slot] = mn[g]
                    else:
                        scale[t, b * gpb + g, slot] = sc[g]
                        if minimum.shape[0]:
                            minimum[t, b * gpb + g, slot] = mn[g]
        seen[t, 0], seen[t, 1] = min(seen[t, 0], low), max(seen[t, 1], high)


FAMILIES = (gguf_first, gguf_lowbit, gguf_grid)  # modules of decoders, each from its kind FIRST on


def _kernel(template, family: ModuleType):
    """`template` over one family's decoders, as a kernel of its own name (a function, not a closure:
    qdot.int_kernel says why): a file compiles the decoders of its own types only, where one kernel
    of every family's compiled them all (docs/benchmarks.md, cold start)."""
    name = f"{template.__name__}_{family.__name__.rsplit('.', 1)[-1]}"
    fn = FunctionType(template.__code__, {**globals(), "_decode": family.decode, "_outer": family.outer}, name)
    fn.__qualname__ = name
    return njit(parallel=True, cache=True)(fn)


ROW_KERNELS = {f.FIRST: _kernel(_rows, f) for f in FAMILIES}
TILED_KERNELS = {f.FIRST: _kernel(_tiled, f) for f in FAMILIES}


def _by_kind(kernels: dict) -> list:
    """Each kind's kernel: its family's (a list, so a row read one token at a time looks it up fast)."""
    return [kernels[max(first for first in kernels if first <= kind)] for kind in range(len(LAYOUTS))]


_ROWS_OF, _TILED_OF = _by_kind(ROW_KERNELS), _by_kind(TILED_KERNELS)


def values(u: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, zero: int) -> np.ndarray:
    """The float32 values row-major codes stand for, rounded as qweight.py's kernels round them:
    scale * (u - zero) (+ minimum), one operation at a time."""
    group = u.shape[1] // scale.shape[1]
    v = np.repeat(scale, group, axis=1) * (u.astype(np.int32) - zero).astype(np.float32)
    return v if minimum is None else v + np.repeat(minimum, group, axis=1)


def unpack(raw: np.ndarray, qtype: str, shape: tuple[int, int]):
    """(u (n, k) uint8, scale (n, groups) float32, minimum or None, zero, bits) of an (out, in) matrix
    whose rows are `raw`'s bytes (any shape with n * k / values-per-block blocks), or None for a type
    held as float."""
    if qtype not in LAYOUTS:
        return None
    size, per, bits, group, zero, affine = LAYOUTS[qtype]
    n, k = shape
    u = np.empty((n, k), np.uint8)
    scale = np.empty((n, k // group), np.float32)
    minimum = np.empty((n if affine else 0, k // group), np.float32)
    _ROWS_OF[KIND[qtype]](np.asarray(raw).reshape(n, -1), KIND[qtype], per, size, u, scale, minimum)
    return u, scale, minimum if affine else None, zero, bits


def tiled_arrays(qtype: str, n: int, k: int) -> tuple:
    """Zeroed arrays an (n, k) matrix of `qtype` is unpacked into at its packed width (`unpack_tiled`):
    codes, scale, minimum (empty when not affine), outer (None but for a K-quant) and seen. The
    padding rows keep scale 0 (an EXPONENT type's: 2^-128, times the zero code). A JOINT type's minimum
    is its scale array (one byte for both)."""
    _, per, _, group, _, affine = LAYOUTS[qtype]
    bits, _ = packed_width(qtype)
    nt, two = -(-n // TILE), qtype in TWO_LEVEL
    dtype = np.uint8 if qtype in JOINT or qtype in EXPONENT else np.int8 if two else np.float32
    scale = _zeros((nt, k // group, TILE), dtype)
    return (_zeros(code_shape(nt, k, bits), np.uint8), scale,
            scale if qtype in JOINT else _zeros((nt if affine else 0, k // group, TILE), dtype),
            _zeros((nt, k // per, 2, TILE), np.uint16) if two else None,
            np.tile(np.array([[255, 0]], np.int32), (nt, 1)))


def _zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeroed memory of its own mapping in small pages: a load writes it once, and a huge page's
    first touch can wait on the kernel compacting memory (numpy asks for huge pages above 4 MB),
    which cost a 0.5B's load a quarter of a second with no gain in decode (docs/weights.md)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < 1 << 20:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, size)  # zero pages, given on first touch
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)


_NO_F32, _NO_I8 = np.zeros((0, 1, TILE), np.float32), np.zeros((0, 1, TILE), np.int8)  # the pair a matrix has not


def unpack_tiled(raw: np.ndarray, qtype: str, shape: tuple[int, int], rows: np.ndarray, lo: int,
                 codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, seen: np.ndarray,
                 width: tuple[int, int] | None = None, outer: np.ndarray | None = None) -> None:
    """unpack(), written as rows lo + i (source row rows[i]) of a tiled matrix (kernels/weights/qweight.py's
    layout at width = (bits, base) -- the type's own 8- or 4-bit codes when None -- : codes (tiles, ..., 4)
    uint8, zeroed at 3, 5 and 6 bits, scale / minimum (tiles, groups, TILE) float32, minimum empty when not
    affine; or, for a K-quant with `outer` (tiles, blocks, 2, TILE) uint16, its integer sub-block scales
    as int8 -- JOINT types' scale and minimum as one uint8 array, a byte for both -- and each block's
    float16 d and -dmin in outer; an EXPONENT type's scale as its uint8 exponent bytes, outer None);
    seen (tiles, 2) int32 gathers each tile's lowest and highest code (a table's: index)."""
    size, per, bits, group, zero, affine = LAYOUTS[qtype]
    bits, base = width or (bits, 0)
    index = INDEX.get(bits, NO_TABLE)
    kind, ints = KIND[qtype], scale.dtype != np.float32  # a K-quant's integers (tiled_arrays), else float32 values
    scales = (_NO_F32, _NO_F32, scale, minimum) if ints else (scale, minimum, _NO_I8, _NO_I8)
    _TILED_OF[kind](np.asarray(raw).reshape(shape[0], -1), kind, per, size, 4 if index.size else bits, base,
                    np.ascontiguousarray(rows, np.int64), lo, codes.view(np.uint32)[..., 0], *scales,
                    NO_OUTER if outer is None else outer, seen, index, qtype in JOINT)  # a table's: 4 bits


class BlockRows:
    """An (out, in) matrix left as a GGUF's blocks in the file's mapping and read a row at a time:
    an untied embedding is only gathered from, one row a token, so it needs no packed copy and
    costs the process only the pages of the rows it reads. Rows come back as the values `native`'s
    packed codes give (scale * (u - zero) (+ minimum), in float32, one operation at a time)."""

    def __init__(self, raw: np.ndarray, qtype: str, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = np.asarray(raw).reshape(shape[0], -1), qtype, tuple(shape)
        self.device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def to(self, device: torch.device) -> "BlockRows":
        if torch.device(device).type != "cpu":
            raise ValueError("a GGUF's blocks are gathered from on the CPU only")
        return self

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """By gguf-py's dequantizer, whose values the codes give bit for bit (tests/test_gguf_quants.py,
        test_gguf_file.py): numpy, so a cold run compiles no row decoder to embed its prompt."""
        flat = idx.reshape(-1).to(torch.int64).numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # a damaged scale: inf / NaN, as the codes give
            got = dequantize(self.raw[flat], GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.asarray(got, np.float32)).view(*idx.shape, self.shape[1])


jitcache.tie(globals(), qdot, gguf_first, gguf_lowbit, gguf_grid, tiled_put)  # the kernels inline the decoders
# (and qdot's half_bits) and tiled_put's writer
