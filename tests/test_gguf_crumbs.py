"""Q2_K and Q3_K run at the file's 2 and 3 bits (codebytes.py: 2-bit codes four to a byte, Q3_K's third
bit in high words beside them, unpacked by shifts and masks in the kernels). The same integers as the
4-bit codes they ran as before, under the same two-level scales, so every integer path gives those
codes' bits, and rows gather to gguf-py's values, on random blocks and on blocks of zero, extreme and
subnormal scales; the layout is the one codebytes.py describes, whichever writer made it."""

from __future__ import annotations

import numpy as np
import pytest

from larqlpy.kernels.weights.gguf_blocks import LAYOUTS, packed_width, tiled_arrays, unpack, unpack_tiled
from larqlpy.kernels.weights.packing import code_shape
from larqlpy.kernels.weights.qweight import TILE, PackedWeight, tile_codes
from test_gguf_quants import packed
from test_gguf_tables import blocks, holds_their_bits

# bits a weight: the codes, a byte per 16 (Q2_K's 4-bit scale and minimum, Q3_K's 6-bit scale), a block's
# d and -dmin per 256: Q2_K's are the file's 2.625
HELD = {"Q2_K": 2 + 8 / 16 + 32 / 256, "Q3_K": 3 + 8 / 16 + 32 / 256}
BEFORE = {"Q2_K": 4 + 8 / 16 + 32 / 256, "Q3_K": 4 + 8 / 16 + 32 / 256}  # the same at 4-bit codes


def layout(u: np.ndarray, bits: int) -> np.ndarray:
    """The tiled layout at 2 or 3 bits, built from codebytes.py's words: byte i of a row's word of unit
    o holds input 16o + 4s + i at bits 2s; at 3 bits, rows [32a, 32a + 32) of units 2G, 2G + 1 keep
    their third bits in unit 2G + a's high words, byte i, field 4 (o mod 2) + s."""
    m, k = u.shape
    t = m // TILE
    crumbs = (u.reshape(t, TILE, k // 16, 4, 4) & 3).astype(np.uint32)  # (tiles, rows, units, s, i)
    low = (crumbs << (2 * np.arange(4))[:, None]).sum(3).astype(np.uint8).transpose(0, 2, 1, 3)
    if bits == 2:
        return low
    third = (u.reshape(t, TILE, k // 32, 8, 4) >> 2).astype(np.uint32)  # field 4 (o mod 2) + s
    words = (third << np.arange(8)[:, None]).sum(3).astype(np.uint8)  # (tiles, rows, pairs, 4)
    areas = words.reshape(t, 2, 32, k // 32, 4).transpose(0, 3, 1, 2, 4).reshape(t, k // 16, 32, 4)
    return np.concatenate([low, areas], axis=2)


@pytest.mark.parametrize("bits,zero", [(2, 0), (2, 1), (3, 4)])
def test_tiling_at_2_and_3_bits_is_the_layout_the_kernels_read(bits, zero):
    n = TILE + 3
    u = np.random.default_rng(bits + zero).integers(0, 2 ** bits, (n, 96), dtype=np.uint8)
    padding = np.full((-n % TILE, 96), zero if bits == 2 else 0, np.uint8)  # 3 bits: zeroed, as 5 and 6
    assert np.array_equal(tile_codes(u, bits, zero), layout(np.concatenate([u, padding]), bits))


def four_bit(raw: np.ndarray, name: str, shape: tuple[int, int]) -> PackedWeight:
    """The matrix as it ran before: the same codes at 4 bits, the same two-level scales."""
    n, k = shape
    _, _, _, _, zero, affine = LAYOUTS[name]
    _, scale, minimum, outer, seen = tiled_arrays(name, n, k)
    codes = np.zeros(code_shape(-(-n // TILE), k, 4), np.uint8)
    unpack_tiled(raw, name, shape, np.arange(n), 0, codes, scale, minimum, seen, (4, 0), outer)
    return PackedWeight.from_tiled(codes, shape, scale, minimum if affine else None, zero, 4, int(seen[:, 0].min()),
                                   int(seen[:, 1].max()), outer=outer)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
@pytest.mark.parametrize("kind", ["random", "edge"])
def test_crumbs_give_the_bits_of_their_4_bit_codes(name, kind):
    raw, shape = blocks(name, kind)
    bits = packed_width(name)[0]
    w, before = packed(raw, name, shape), four_bit(raw, name, shape)
    assert (w.kind, w.bits, before.bits) == (f"u{bits}", bits, 4) and w.path == before.path
    n_padded = w.codes.shape[0] * TILE
    assert w.nbytes * 8 / (n_padded * shape[1]) == pytest.approx(HELD[name])
    assert before.nbytes * 8 / (n_padded * shape[1]) == pytest.approx(BEFORE[name])
    u, _, _, zero, _ = unpack(raw, name, shape)  # the row-major codes, tiled by the other writer
    assert np.array_equal(w.codes.numpy(), tile_codes(u, bits, zero))
    holds_their_bits(w, before, raw, name, shape, kind)
