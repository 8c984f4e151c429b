"""A few activation rows times packed integer weight codes, on the CPU (decode and short prefills).

Weight value: scale * (u - zero) (+ minimum, affine formats), per group of G inputs of one output row.

Integer paths (`vnni512`, `avx2`, `avx2-signed`): the activation row x is rounded per group of G
to int8, x ~ xs * xq with xs = max|x| / 127 (llama.cpp's Q8 activations; fbgemm does the same per
row), the group's exact int32 sum  sum(u * xq)  comes from the simd.py intrinsics, and
    y[r] += scale * (xs * (sum(u * xq) - zero * sum(xq)))  (+ minimum * xs * sum(xq)).
The int32 sums are exact and the float steps are the same code in every kernel (no fast-math), so
all integer paths give the same numbers bit for bit: y = W x^ to float32 rounding, x^ = xs * xq.

`float` path: the activations stay float32 (y = W x to float32 rounding). Slower; it runs where the
CPU has neither instruction set and whenever a caller asks for it.
"""

from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from larqlpy.kernels import jitcache, workshare
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.weights import codebytes, rounding, simd
from larqlpy.kernels.weights.codebytes import E8M0
from larqlpy.kernels.weights.rounding import quantize_activations, quantize_all  # noqa: F401 (qdot's API)
from larqlpy.kernels.weights.simd import DOTS
from larqlpy.kernels.weights.simd import ROWS as TILE
from larqlpy.kernels.weights.simd import WIDEST as ROWS_PER_CALL


def as_float(v):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


# 2^(e - 25) for a float16's exponent field e (2^-24 at 0: subnormals; inf at 31); a table, not
# ldexp's libm call. With the two below it keeps half_bits free of branches: numba's IR inliner
# warned (NumbaIRAssumptionWarning) on the phis of a branching one inlined into the kernels.
_HALF_POWERS = np.append(np.ldexp(np.float32(1), np.maximum(np.arange(31), 1) - 25), np.inf).astype(np.float32)
_NAN_IF = np.array([0.0, np.nan], np.float32)  # added: NaN where the field is 31 and the mantissa not 0
_SIGNS = np.array([1.0, -1.0], np.float32)


@njit(inline="always", cache=True)
def half_bits(h):  # pragma: no cover - jitted
    """float16 bits -> float32, exactly (every float16 is a float32): (1024 + m) * 2^(e - 25), m * 2^-24
    below, products by a power of two."""
    h = np.int32(h)
    e, m = (h >> 10) & 31, h & 1023
    v = np.float32(m + 1024 * np.int32(e != 0)) * _HALF_POWERS[e] + _NAN_IF[np.int32((e == 31) & (m != 0))]
    return v * _SIGNS[(h >> 15) & 1]


@overload(as_float, inline="always")
def _as_float(v):
    """A scale or minimum as float32: stored as float32, or as float16 bits (uint16) where the values
    are float16 exactly (qweight.py), which saves 2 bytes per group, or as an E8M0 exponent byte
    (uint8 without `outer`: MXFP4's 2^(e - 128), codebytes.EXPONENTS)."""
    if isinstance(v, types.Integer) and not v.signed and v.bitwidth == 8:
        return lambda v: E8M0[v]
    if isinstance(v, types.Integer):
        return lambda v: half_bits(v)
    return lambda v: v


def sub_value(v, which):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(sub_value, inline="always")
def _sub_value(v, which):
    """A K-quant's integer sub-block scale (which 0) or minimum (1): held as int8, or as Q2_K's one
    byte for both (uint8: the scale in the low nibble, the minimum in the high, as the file has them)."""
    if isinstance(v, types.Integer) and not v.signed and v.bitwidth == 8:
        return lambda v, which: (np.int32(v) >> (4 * which)) & 15
    return lambda v, which: v


INT_PATHS = ("vnni512", "avx2", "avx2-signed")
NO_OUTER = np.zeros((0, 1, 2, TILE), np.uint16)  # a matrix whose scales and minimums are whole values


@njit(inline="always", cache=True)
def group_value(a, outer, t, g, r, which):  # pragma: no cover - jitted
    """Group g's scale (a = scale, which 0) or minimum (a = minimum, which 1) of row r of tile t: as
    stored, or, beside a K-quant's `outer` (tiles, blocks, 2, TILE), its block's float16 d (or -dmin)
    times the integer sub-block value (`sub_value`) -- a product exact in float32, so the value the
    file's dequantization gives."""
    if outer.shape[0]:
        return half_bits(outer[t, g // (a.shape[1] // outer.shape[1]), which, r]) * \
            np.float32(sub_value(a[t, g, r], which))
    return as_float(a[t, g, r])

# Chunks a thread takes in a product, on average: runs of contiguous tiles stream like a thread's fixed
# half did (one tile a chunk cost 9% of int4 decode's products on the 0.5B, docs/benchmarks.md), and a
# thread that loses its core still holds up only its one chunk.
CHUNKS_PER_SLOT = 4


# What `_int_template` reads as globals; each kernel is the template under its own values (`int_kernel`).
WIDEST = X_PER = SPAN = 0
DOT = DOT_HALF = DOT_LATE = None
HALVES = LATE_APART = False  # constants: numba prunes the branches on them, so a kernel holds one group size's code


def _int_template(codes, scale, minimum, outer, zc, x, out, ahead, slots):  # pragma: no cover - jitted
    """The integer kernels' one body (see `int_kernel`). codes: (tiles, units, TILE * SPAN / 4, 4) uint8;
    x: (M, k) float32, rounded to int8 per group here first (`quantize_activations`' rounding: one
    call where a product of one row is mostly calls); outer: a K-quant's blocks' d and -dmin
    (`group_value`), or NO_OUTER. The group loop is outside the row loop, so a group's codes are
    read from memory once per tile. Its constants and intrinsics (WIDEST ... DOT_HALF) are globals each
    kernel binds its own way. ahead: how far past each group's codes its first row block prefetches
    (0: none; kernels/weights/prefetch.py). A half group (of 16) at an odd index runs DOT_LATE: at 5 bits
    its codes' high words lie before it (codebytes.code_bytes' `first`)."""
    nt, kw, ng, m_rows, nb = codes.shape[0], codes.shape[1], scale.shape[1], x.shape[0], outer.shape[1]
    group = x.shape[1] // ng
    xq8, xs, sxq = np.empty(x.shape, np.int8), np.empty((m_rows, ng), np.float32), np.empty((m_rows, ng), np.int32)
    quantize_all(x, group, xq8, xs, sxq)
    nw, cf, xf, sf, mf, of, xsf, qf = kw // ng, codes.reshape(-1), xq8.view(np.int32).reshape(-1), \
        scale.reshape(-1), minimum.reshape(-1), outer.reshape(-1), xs.reshape(-1), sxq.reshape(-1)
    affine, per_block, count = minimum.shape[0] > 0, ng // nb, workshare.counter()
    per = max(1, nt // (slots * CHUNKS_PER_SLOT))
    chunks = (nt + per - 1) // per
    for _ in prange(slots):  # each thread takes the next chunk of tiles while any is left (workshare.py)
        c = workshare.take(count)
        while c < chunks:
            for t in range(c * per, min(nt, (c + 1) * per)):
                acc = np.zeros(m_rows * TILE, np.float32)
                for g in range(ng):
                    base, so, m = (t * kw + g * nw) * TILE * SPAN, (t * ng + g) * TILE, 0
                    oo = (t * nb + g // per_block) * 2 * TILE
                    while m < m_rows:
                        n = min(m_rows - m, WIDEST)
                        a = (n, acc, m * TILE, cf, base, xf, X_PER * (m * kw + g * nw), X_PER * kw, sf, so, mf, of,
                             oo, xsf, qf, m * ng + g, ng, zc, affine, ahead if m == 0 else 0)
                        if HALVES:
                            if LATE_APART and g % 2:
                                DOT_LATE(*a)
                            else:
                                DOT_HALF(*a)
                        else:
                            DOT(*a)
                        m += n
                out[:, t * TILE:(t + 1) * TILE] = acc.reshape(m_rows, TILE)
            c = workshare.take(count)


def int_kernel(template, isa: str, bits, halves: bool = False, prefix: str = "_int"):
    """The kernel of one instruction set and code width, made from `template` (`_int_template`, or
    another reading the same globals: qmany.py's) with its own globals, named prefix + width + isa:
    a kernel that names an instruction the CPU lacks is never compiled there, so each pair is its
    own function. Not a closure: numba keys a cached closure on a pickle of what it closes
    over, and a pickled intrinsic differs in every process, so such a kernel would compile afresh in
    each one. A function of its own name and globals is cached under that name like any other.
    VNNI takes up to 8 activation rows per intrinsic call, AVX2 2 (simd.WIDEST); a unit of codes
    (simd.parts: 1, 2 or 4 activation words, of simd.span bytes a row) is one code word a row; groups
    of 16 inputs have their own intrinsics, and kernels (`halves`): a matrix has one group size, and
    one kernel of both compiled twice the code a file runs. bits: a code width, or a table's name
    (simd.TABLES)."""
    firsts = simd.firsts(bits, 4)
    bound = dict(WIDEST=ROWS_PER_CALL[isa], X_PER=simd.parts(bits), FULL=8 // simd.parts(bits), SPAN=simd.span(bits),
                 DOT=DOTS[(isa, bits, 8, 0)], DOT_HALF=DOTS[(isa, bits, 4, 0)],
                 DOT_LATE=DOTS[(isa, bits, 4, firsts[-1])], HALVES=halves, LATE_APART=len(firsts) > 1)
    name = f"{prefix}{bits}_{isa.replace('-', '_')}{'_halves' if halves else ''}"
    fn = FunctionType(template.__code__, {**template.__globals__, **bound}, name)
    fn.__qualname__ = name
    return njit(parallel=True, cache=True, error_model="numpy")(fn)


# --- float activations --------------------------------------------------------------------------

@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _float8(codes, scale, minimum, outer, zero, x, xsum, out):  # pragma: no cover - jitted
    nt, kq, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], x.shape[0]
    nq, affine, z = kq // ng, minimum.shape[0] > 0, np.float32(zero)
    words = codes.view(np.uint32)  # (tiles, k/4, TILE, 1): row r's four codes in one 32-bit word
    m8 = np.uint32(255)
    for t in prange(nt):
        acc, s = np.zeros((m_rows, TILE), np.float32), np.empty(TILE, np.float32)
        for g in range(ng):
            for m in range(m_rows):
                s[:] = 0.0
                for p in range(g * nq, (g + 1) * nq):
                    x0, x1, x2, x3 = x[m, 4 * p], x[m, 4 * p + 1], x[m, 4 * p + 2], x[m, 4 * p + 3]
                    for r in range(TILE):
                        w = words[t, p, r, 0]
                        s[r] += ((np.float32(w & m8) - z) * x0 + (np.float32((w >> np.uint32(8)) & m8) - z) * x1) + \
                            ((np.float32((w >> np.uint32(16)) & m8) - z) * x2 +
                             (np.float32(w >> np.uint32(24)) - z) * x3)
                for r in range(TILE):
                    acc[m, r] += group_value(scale, outer, t, g, r, 0) * s[r]
                if affine:
                    for r in range(TILE):
                        acc[m, r] += group_value(minimum, outer, t, g, r, 1) * xsum[m, g]
        for m in range(m_rows):
            out[m, t * TILE:(t + 1) * TILE] = acc[m]


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def _add_group(acc, m, s, z, scale, minimum, outer, xsum, t, g, affine):  # pragma: no cover - jitted
    """Row m's sums s of group g's codes times x, scaled into acc: scale * (s - zero * sum(x)) (+
    minimum * sum(x)), the float paths' epilogue for codes with a zero point."""
    for r in range(TILE):
        acc[m, r] += group_value(scale, outer, t, g, r, 0) * (s[r] - z * xsum[m, g])
    if affine:
        for r in range(TILE):
            acc[m, r] += group_value(minimum, outer, t, g, r, 1) * xsum[m, g]


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _float4(codes, scale, minimum, outer, zero, x, xsum, out):  # pragma: no cover - jitted
    nt, ko, ng, m_rows = codes.shape[0], codes.shape[1], scale.shape[1], x.shape[0]
    no, affine, z = ko // ng, minimum.shape[0] > 0, np.float32(zero)
    words = codes.view(np.uint32)  # byte i of row r's word: inputs 8o+i (low nibble) and 8o+4+i (high)
    m4 = np.uint32(15)
    for t in prange(nt):
        acc, s = np.zeros((m_rows, TILE), np.float32), np.empty(TILE, np.float32)
        xo = np.empty(8, np.float32)
        for g in range(ng):
            for m in range(m_rows):
                s[:] = 0.0
                for o in range(g * no, (g + 1) * no):
                    for i in range(8):
                        xo[i] = x[m, 8 * o + i]
                    for r in range(TILE):
                        w = words[t, o, r, 0]
                        a = np.float32(w & m4) * xo[0] + np.float32((w >> np.uint32(8)) & m4) * xo[1] + \
                            np.float32((w >> np.uint32(16)) & m4) * xo[2] + \
                            np.float32((w >> np.uint32(24)) & m4) * xo[3]
                        b = np.float32((w >> np.uint32(4)) & m4) * xo[4] + \
                            np.float32((w >> np.uint32(12)) & m4) * xo[5] + \
                            np.float32((w >> np.uint32(20)) & m4) * xo[6] + np.float32(w >> np.uint32(28)) * xo[7]
                        s[r] += a + b
                _add_group(acc, m, s, z, scale, minimum, outer, xsum, t, g, affine)
        for m in range(m_rows):
            out[m, t * TILE:(t + 1) * TILE] = acc[m]


@njit(cache=True, error_model="numpy")
def group_sums(x, group, out):  # pragma: no cover - jitted
    for m in range(x.shape[0]):
        for g in range(x.shape[1] // group):
            s = np.float32(0.0)
            for j in range(g * group, (g + 1) * group):
                s += x[m, j]
            out[m, g] = s


@njit(inline="always", cache=True)
def code_at(codes, bits, t, j, r, table):  # pragma: no cover - jitted
    """Row r of tile t's code for input j, in the tiled layout of `bits` (qweight.py); a nibble stands
    for table[nibble] where `table` is not empty (simd.TABLES)."""
    if bits == 8:
        return np.int32(codes[t, j // 4, r, j % 4])
    if bits < 4:  # crumbs: input 16o + 4s + i at bits 2s of byte i; 3 bits: the third from the row's word
        o, s = j // 16, (j % 16) // 4
        u = np.int32(codes[t, o, r, j % 4] >> (2 * s)) & 3
        if bits == 3:  # a word per row per 2 units, 32 rows an area, field 4 (o mod 2) + s (simd.high_at)
            high = codes[t, o // 2 * 2 + r // 32, TILE + r % 32, j % 4]
            u |= np.int32((high >> (4 * (o % 2) + s)) & 1) << 2
        return u
    o, half = j // 8, (j % 8) // 4
    b = codes[t, o, r, j % 4]
    u = np.int32(b >> 4) if half else np.int32(b & 15)
    if bits > 4:  # 5, 6 bits: the high bits from the row's word (simd.high_at)
        p = bits - 4
        per, slots = 4 // p, TILE * p // 4
        field = 2 * (o % per) + half
        high = codes[t, o // per * per + r // slots, TILE + r % slots, j % 4]
        u |= np.int32((high >> (field * p)) & ((1 << p) - 1)) << 4
    return np.int32(table[u]) if table.shape[0] else u


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _float_planes(codes, scale, minimum, outer, zero, bits, table, x, xsum, out):  # pragma: no cover - jitted
    """2-, 3-, 5- and 6-bit codes and tables with float activations: each code read on its own (`code_at`).
    This path runs only where the CPU has no integer one, or when a caller asks for it."""
    nt, ng, m_rows, k = codes.shape[0], scale.shape[1], x.shape[0], x.shape[1]
    group, affine, z = k // ng, minimum.shape[0] > 0, np.float32(zero)
    for t in prange(nt):
        acc, s = np.zeros((m_rows, TILE), np.float32), np.empty(TILE, np.float32)
        for g in range(ng):
            for m in range(m_rows):
                s[:] = 0.0
                for j in range(g * group, (g + 1) * group):
                    for r in range(TILE):
                        s[r] += np.float32(code_at(codes, bits, t, j, r, table)) * x[m, j]
                _add_group(acc, m, s, z, scale, minimum, outer, xsum, t, g, affine)
        for m in range(m_rows):
            out[m, t * TILE:(t + 1) * TILE] = acc[m]


INT = {(isa, bits): int_kernel(_int_template, isa, bits) for isa in INT_PATHS for bits in simd.WIDTHS
       if simd.fits(isa, bits)}
HALVES_INT = {key: int_kernel(_int_template, *key, True) for key in INT}  # groups of 16 (Q6_K, Q2_K, Q3_K, ...)
FLOAT = {8: _float8, 4: _float4}
NO_TABLE = np.zeros(0, np.uint8)
HALF_GROUP = 16  # inputs a group of the `halves` kernels; every other matrix's groups are of 32
SLOTS = workshare.slots()


def gemm(codes, scale, minimum, outer, zero: int, bits: int, x: np.ndarray, path: str, out: np.ndarray,
         ahead: int = 0) -> None:
    """out (M, tiles * TILE) = x (M, k) float32 times the packed codes, on `path`; the integer paths
    prefetch the codes `ahead` bytes ahead (0: not at all), which changes no number. bits: the codes'
    width, or their table's name (simd.TABLES)."""
    if path == "float":
        xsum = np.empty((x.shape[0], scale.shape[1]), np.float32)
        group_sums(x, x.shape[1] // scale.shape[1], xsum)
        if bits in FLOAT:
            FLOAT[bits](codes, scale, minimum, outer, zero, x, xsum, out)
        else:
            _float_planes(codes, scale, minimum, outer, zero, simd.layout_bits(bits), simd.TABLES.get(bits, NO_TABLE),
                          x, xsum, out)
        return
    zc = zero - 128 if path == "avx2-signed" else zero  # its sums are of (u - 128) * xq
    halves = x.shape[1] // scale.shape[1] == HALF_GROUP
    (HALVES_INT if halves else INT)[(path, bits)](codes, scale, minimum, outer, zc, x, out, ahead, SLOTS)


# they inline simd.py's intrinsics, workshare's counter, rounding's activations
jitcache.tie(globals(), simd, codebytes, jitcache, workshare, rounding)
