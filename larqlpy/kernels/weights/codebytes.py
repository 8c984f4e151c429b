"""Weight codes as the integer kernels find them in memory, and the LLVM IR that turns a vector of them
into one byte per code for the dot products (simd.py).

The layouts (qweight.py, packing.py):
    8-bit codes: per quad of inputs (4j..4j+3), 64 rows x 4 bytes (row r's four codes adjacent);
    4-bit codes: per octet (8j..8j+7), 64 rows x 4 bytes, low nibbles inputs 8j..8j+3, high 8j+4..8j+7;
    5- and 6-bit codes: per octet, the 4-bit layout of their low four bits, then P = 1 (5-bit) or 2
    (6-bit) x 64 bytes of high bits (`high_at`): a 32-bit word per row for every 4 / P octets, whose
    byte i holds, in field f = 2 (o mod 4/P) + h (bits f P .. f P + P - 1), the high bits of input
    8o + 4h + i -- so a shift and a mask put them beside the nibbles of the same byte. The words of
    an octet group's rows 0 .. 16P - 1 lie after its first octet's nibbles, the next 16P rows after
    its second's, and so on;
    table codes (`TABLES`: IQ4_NL's and IQ4_XS's non-linear grid): the 4-bit layout of the file's own
    nibbles, each turned into the byte it stands for by a byte shuffle (`vpshufb`, the 16-byte table
    in every 128-bit lane, as llama.cpp does) before the dot product -- the same bytes, so the same
    sums, as 8-bit codes of those values.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
ROWS = 64  # the tile: qweight.TILE
# Table widths: 4-bit indices whose codes are these bytes (IQ4_NL's and IQ4_XS's grid + 128, zero 128)
TABLES = {"iq4": (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128
                  ).astype(np.uint8)}
PLANES = {8: 0, 4: 0, 5: 1, 6: 2, **{name: 0 for name in TABLES}}  # code width -> its bits above the nibbles (P)


def layout_bits(width) -> int:
    """The bits a code of `width` takes in the layout: a table's indices are nibbles."""
    return 4 if width in TABLES else width


def high_at(planes: int, octet: int, row: int) -> tuple[int, int, int]:
    """Where the high bits of `row`'s codes of `octet` lie in the 5- / 6-bit layout (P = `planes`):
    (the octet whose area holds the word, the word's slot in that area, the octet's field f in each
    byte: inputs 8o + i at field f, 8o + 4 + i at f + 1)."""
    per, slots = 4 // planes, ROWS * planes // 4
    return octet // per * per + row // slots, row % slots, 2 * (octet % per)


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


def code_bytes(builder, codes_at, width, octet: int, v: int, lanes: int, first: int = 0, signed: bool = False):
    """The code bytes of rows v * lanes .. of one octet (4-, 5-, 6-bit, tables) or quad (8-bit) as
    <lanes x i32> vectors: [the codes] for 8 bits, else [inputs 8j..8j+3, inputs 8j+4..8j+7], each
    byte one code: its high bits (5, 6 bits) shifted out of the rows' high words and masked into place,
    or a table's value looked up. first: the group's first octet within its high words' span of 4 / P
    octets (a 5-bit group of 16 may start halfway: its words lie before it). signed: each code less
    128, as a signed byte (AVX2's signed form)."""
    vty = ir.VectorType(I32, lanes)
    span = 4 + PLANES[width]  # bytes a row takes per octet (or quad)
    raw = codes_at(octet * ROWS * span + v * lanes * 4, vty)

    def const(value):
        return splat(builder, ir.Constant(I32, value), vty)

    if width == 8:
        return [builder.xor(raw, const(0x80808080)) if signed else raw]
    mask = const(0x0F0F0F0F)
    parts = [builder.and_(raw, mask), builder.and_(builder.lshr(raw, const(4)), mask)]
    if width in TABLES:
        return [look_up(builder, part, TABLES[width] ^ (0x80 if signed else 0)) for part in parts]
    p = PLANES[width]
    if p:
        area, slot, field = high_at(p, first + octet, v * lanes)
        word = codes_at((area - first) * ROWS * span + ROWS * 4 + slot * 4, vty)
        top = const(((1 << p) - 1) * 0x10101010)  # the code's bits 4 .. 3 + P in every byte
        for h in range(2):
            shift = 4 - (field + h) * p
            moved = builder.shl(word, const(shift)) if shift > 0 else \
                builder.lshr(word, const(-shift)) if shift < 0 else word
            parts[h] = builder.or_(parts[h], builder.and_(moved, top))
    return [builder.xor(part, const(0x80808080)) for part in parts] if signed else parts


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
