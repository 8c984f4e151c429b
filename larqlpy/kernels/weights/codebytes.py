"""Weight codes as the integer kernels find them in memory, and the LLVM IR that turns a vector of them
into one byte per code for the dot products (simd.py).

The layouts (qweight.py, packing.py), per unit of inputs, 64 rows x 4 bytes (row r's word) each:
    8-bit codes: per quad of inputs (4j..4j+3), row r's four codes adjacent;
    4-bit codes: per octet (8j..8j+7), low nibbles inputs 8j..8j+3, high 8j+4..8j+7;
    2-bit codes: per 16 inputs, byte i holding inputs 16j + 4s + i at bits 2s (s = 0..3: `parts`);
    5- and 6-bit codes (and 3-bit): the 4-bit (2-bit) layout of their low four (two) bits, then
    16 P (32 P) rows of high bits (`high_at`), P = 1 (5, 3 bits) or 2 (6 bits): a 32-bit word per row
    for every `per` = 8 / (P parts) units, whose byte i holds, in field f = parts (o mod per) + s
    (bits f P .. f P + P - 1), the high bits of input o's part s, byte i -- so a shift and a mask put
    them beside the low bits of the same byte. The words of a unit group's rows 0 .. 64 / per - 1 lie
    after its first unit's low bits, the next 64 / per rows after its second's, and so on;
    table codes (`TABLES`: IQ4_NL's and IQ4_XS's non-linear grid, MXFP4's doubled e2m1 values): the
    4-bit layout of the file's own nibbles, each turned into the byte it stands for by a byte shuffle
    (`vpshufb`, the 16-byte table in every 128-bit lane, as llama.cpp does) before the dot product --
    the same bytes, so the same sums, as 8-bit codes of those values. A table of `EXPONENTS` may hold
    its group scales as the file's E8M0 exponent bytes e (uint8), each standing for 2^(e - 128)
    (`E8M0`, `exponent_floats`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
ROWS = 64  # the tile: qweight.TILE
# Table widths: 4-bit indices whose codes are these bytes, zero 128: IQ4_NL's and IQ4_XS's grid + 128;
# MXFP4's e2m1 values doubled (0, 0.5 .. 6 -> 0, 1 .. 12; indices 8-15 the negatives, 8 a second 0) + 128
TABLES = {"iq4": (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128
                  ).astype(np.uint8),
          "fp4": (np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]) + 128).astype(np.uint8)}
EXPONENTS = ("fp4",)  # tables whose uint8 group scales are E8M0 exponent bytes (MXFP4's, held as the file has them)


def _e8m0_half() -> np.ndarray:
    """2^(e - 128) for each exponent byte e, as ggml_e8m0_to_fp32_half builds it (subnormal below
    e = 2): the float32 gguf-py multiplies MXFP4's doubled values by."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


E8M0 = _e8m0_half()
# code width -> the bits of each code its words' bytes hold (LOW), and its bits above those (P)
LOW = {8: 8, 4: 4, 5: 4, 6: 4, 2: 2, 3: 2, **{name: 4 for name in TABLES}}
PLANES = {8: 0, 4: 0, 5: 1, 6: 2, 2: 0, 3: 1, **{name: 0 for name in TABLES}}


def layout_bits(width) -> int:
    """The bits a code of `width` takes in the layout: a table's indices are nibbles."""
    return 4 if width in TABLES else width


def parts(width) -> int:
    """Codes a byte of the words holds (1, 2 or 4): a unit is 4 x parts inputs, as many int32 words of
    activations (four int8 each)."""
    return 8 // LOW[width]


def span(width) -> int:
    """Bytes a row takes per unit: its word, and its high bits' share of a high word."""
    return 4 + parts(width) * PLANES[width] // 2


def high_at(width, unit: int, row: int) -> tuple[int, int, int]:
    """Where the high bits of `row`'s codes of `unit` lie (`PLANES[width]` > 0): (the unit whose area
    holds the word, the word's slot in that area, the unit's field f in each byte: its part s at f + s)."""
    n = parts(width)
    per = 8 // (PLANES[width] * n)
    slots = ROWS // per
    return unit // per * per + row // slots, row % slots, n * (unit % per)


def fn(builder, name: str, ret, args):
    """The module's declaration of function `name` (an LLVM intrinsic), made on first use."""
    module = builder.module
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(ret, args), name=name)


def splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def code_bytes(builder, codes_at, width, unit: int, v: int, lanes: int, first: int = 0, signed: bool = False):
    """The code bytes of rows v * lanes .. of one unit as <lanes x i32> vectors, one per part: [the
    codes] for 8 bits, [inputs 8j..8j+3, 8j+4..8j+7] for nibbles, [16j + 4s .. 16j + 4s + 3 for s =
    0..3] for crumbs (2, 3 bits), each byte one code: its high bits (3, 5, 6 bits) shifted out of the
    rows' high words and masked into place, or a table's value looked up. first: the group's first
    unit within its high words' span (a 5-bit or 3-bit group of 16 may start halfway: its words lie
    before it). signed: each code less 128, as a signed byte (AVX2's signed form)."""
    vty = ir.VectorType(I32, lanes)
    size = span(width)
    raw = codes_at(unit * ROWS * size + v * lanes * 4, vty)

    def const(value):
        return splat(builder, ir.Constant(I32, value), vty)

    def shifted(word, shift):  # left for shift > 0, right for shift < 0
        return builder.shl(word, const(shift)) if shift > 0 else \
            builder.lshr(word, const(-shift)) if shift < 0 else word

    if width == 8:
        return [builder.xor(raw, const(0x80808080)) if signed else raw]
    low = LOW[width]
    mask = const(((1 << low) - 1) * 0x01010101)
    codes = [builder.and_(shifted(raw, -low * s), mask) for s in range(parts(width))]
    if width in TABLES:
        return [look_up(builder, part, TABLES[width] ^ (0x80 if signed else 0)) for part in codes]
    p = PLANES[width]
    if p:
        area, slot, field = high_at(width, first + unit, v * lanes)
        word = codes_at((area - first) * ROWS * size + ROWS * 4 + slot * 4, vty)
        top = const((((1 << p) - 1) << low) * 0x01010101)  # the code's bits low .. low + P - 1 in every byte
        for s in range(len(codes)):
            codes[s] = builder.or_(codes[s], builder.and_(shifted(word, low - (field + s) * p), top))
    return [builder.xor(part, const(0x80808080)) for part in codes] if signed else codes


def look_up(builder, nibbles, table: np.ndarray):
    """Each byte (0..15) of `nibbles` replaced by table[byte]: one vpshufb, the table in every 128-bit
    lane (AVX-512BW for 64 bytes, AVX2 for 32)."""
    n = nibbles.type.count * 4
    bty = ir.VectorType(I8, n)
    name = "llvm.x86.avx512.pshuf.b.512" if n == 64 else "llvm.x86.avx2.pshuf.b"
    shuffle = fn(builder, name, bty, [bty, bty])
    looked = builder.call(shuffle, [ir.Constant(bty, [int(b) for b in table.view(np.int8)] * (n // 16)),
                                    builder.bitcast(nibbles, bty)])
    return builder.bitcast(looked, nibbles.type)


def exponent_floats(builder, exponents, fv):
    """E8M0 exponent bytes (a <n x i8> vector) as the float32 vector `fv` of 2^(e - 128), `E8M0`'s
    values: (e - 1) << 23, or 2^21 << e below e = 2 (subnormal), as float bits."""
    iv = ir.VectorType(I32, fv.count)
    e = builder.zext(exponents, iv)

    def const(value):
        return ir.Constant(iv, [value] * fv.count)

    normal = builder.shl(builder.sub(e, const(1)), const(23))
    small = builder.shl(const(0x00200000), builder.and_(e, const(1)))  # e is 0 or 1 where it is taken
    return builder.bitcast(builder.select(builder.icmp_unsigned("<", e, const(2)), small, normal), fv)
