"""IQ4_NL and IQ4_XS run at the file's 4 bits (simd.TABLES): the file's nibbles, turned into their grid's
bytes by a byte shuffle in the integer kernels. The same integers as the 8-bit codes `kv + 128` they ran
as before, under the same group scales, so every integer path gives those codes' bits, and rows
gather to gguf-py's values, on random blocks and on blocks of zero, extreme and subnormal scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from larqlpy.kernels import cpu
from larqlpy.kernels.weights.gguf_blocks import HALF_SCALES, LAYOUTS, tiled_arrays, unpack_tiled
from larqlpy.kernels.weights.packing import code_shape
from larqlpy.kernels.weights.qweight import TILE, PackedWeight
from larqlpy.kernels.weights.simd import fits
from test_gguf_quants import edge_blocks, packed, reference, same_bits
from test_native import random_blocks

Q = gguf.GGMLQuantizationType
TABLED = ("IQ4_NL", "IQ4_XS")
HELD = {"IQ4_NL": 4.5, "IQ4_XS": 4.375}  # bits a weight: the file's 4.5 / 4.25, IQ4_XS's -dmin slot unused


def eight_bit(raw: np.ndarray, name: str, shape: tuple[int, int]) -> PackedWeight:
    """The matrix as it ran before: 8-bit codes kv + 128, the same (two-level) scales."""
    n, k = shape
    _, scale, minimum, outer, seen = tiled_arrays(name, n, k)
    codes = np.zeros(code_shape(-(-n // TILE), k, 8), np.uint8)
    unpack_tiled(raw, name, shape, np.arange(n), 0, codes, scale, minimum, seen, (8, 0), outer)
    return PackedWeight.from_tiled(codes, shape, scale, None, 128, 8, int(seen[:, 0].min()), int(seen[:, 1].max()),
                                   halves=name in HALF_SCALES, outer=outer)


def blocks(name: str, kind: str) -> tuple[np.ndarray, tuple[int, int]]:
    """Random blocks (TILE + 5 rows of 512), or the edge blocks (test_gguf_quants.edge_blocks) as 4 rows."""
    per = LAYOUTS[name][1]
    if kind == "random":
        n, k = TILE + 5, 512
        return random_blocks(Q[name], n * k // per, seed=23 + len(name)).reshape(n, -1), (n, k)
    raw = edge_blocks(name)
    return raw.reshape(4, -1), (4, len(raw) // 4 * per)


@pytest.mark.parametrize("name", TABLED)
@pytest.mark.parametrize("kind", ["random", "edge"])
def test_table_codes_give_the_bits_of_their_8_bit_codes(name, kind):
    raw, shape = blocks(name, kind)
    w, before = packed(raw, name, shape), eight_bit(raw, name, shape)
    assert w.kind == "iq4" and w.bits == 4 and w.path == before.path
    held = w.nbytes * 8 / (w.codes.shape[0] * TILE * shape[1])
    assert held == pytest.approx(HELD[name]) and w.nbytes < before.nbytes * 0.6
    holds_their_bits(w, before, raw, name, shape, kind)


def holds_their_bits(w: PackedWeight, before: PackedWeight, raw: np.ndarray, name: str, shape: tuple[int, int],
                     kind: str) -> None:
    """w's rows gather to gguf-py's values, every integer path this CPU has gives `before`'s bits for 1,
    2, 3 and 8 rows, and on random blocks the float path (a GEMV, and slabs past 16 rows) gives gguf-py's
    values times x."""
    want = reference(raw, name, shape)
    idx = torch.tensor(sorted({0, 3, shape[0] - 1}))
    for rows in (w.rows(idx), w._rows_torch(idx)):
        assert same_bits(rows.numpy(), want[idx.numpy()])
    x = torch.randn(8, shape[1], generator=torch.Generator().manual_seed(2))
    ints = [p for p in cpu.runnable_paths() if p != "float" and fits(p, w.width)]
    assert ints or not cpu.runnable_paths()[:-1]  # every integer path this CPU has takes them
    for path in ints:
        for rows in (1, 2, 3, 8):
            assert same_bits(w.matmul(x[:rows], path).numpy(), before.matmul(x[:rows], path).numpy()), (path, rows)
    if kind == "random":
        for xs in (x[:1], x[:8], torch.randn(40, shape[1])):
            exact = xs.double().numpy() @ want.astype(np.float64).T
            assert np.abs(w.matmul(xs, "float").double().numpy() - exact).max() <= 1e-5 * np.abs(exact).max()
