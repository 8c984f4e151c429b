"""IQ4_NL, IQ4_XS and MXFP4 run at the file's 4 bits (simd.TABLES): the file's nibbles, turned into their
table's bytes by a byte shuffle in the integer kernels (MXFP4's scales the file's exponent bytes). The
same integers as 8-bit codes `kv + 128` under the same group scale values, so every integer path gives
those codes' bits, and rows gather to gguf-py's values, on random blocks and on blocks of zero,
extreme and subnormal scales (MXFP4: exponents 0, 1, 2, 127, 128, 254, 255)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from larqlpy.kernels import cpu
from larqlpy.kernels.weights import qmany
from larqlpy.kernels.weights.gguf_blocks import HALF_SCALES, LAYOUTS, tiled_arrays, unpack_tiled
from larqlpy.kernels.weights.packing import code_shape
from larqlpy.kernels.weights.qweight import TILE, PackedWeight
from larqlpy.kernels.weights.simd import fits
from test_gguf_quants import edge_blocks, packed, reference, same_bits
from test_native import random_blocks

Q = gguf.GGMLQuantizationType
TABLED = {"IQ4_NL": "iq4", "IQ4_XS": "iq4", "MXFP4": "fp4"}
HELD = {"IQ4_NL": 4.5, "IQ4_XS": 4.375, "MXFP4": 4.25}  # bits a weight: the file's 4.5 / 4.25 / 4.25 (IQ4_XS's
# -dmin slot unused)


def eight_bit(raw: np.ndarray, name: str, shape: tuple[int, int]) -> PackedWeight:
    """The matrix as 8-bit codes kv + 128 under the same (two-level) scales, MXFP4's exponents as the
    float32 values they stand for (how it ran before: 5-bit codes, float32 scales)."""
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
        raw = random_blocks(Q[name], n * k // per, seed=23 + len(name))
        if name == "MXFP4":  # exponents near a weight's: random ones overflow the sums to inf - inf
            raw[:, 0] = np.random.default_rng(3).integers(118, 130, len(raw))
        return raw.reshape(n, -1), (n, k)
    raw = edge_blocks(name)
    return raw.reshape(4, -1), (4, len(raw) // 4 * per)


@pytest.mark.parametrize("name", TABLED)
@pytest.mark.parametrize("kind", ["random", "edge"])
def test_table_codes_give_the_bits_of_their_8_bit_codes(name, kind):
    raw, shape = blocks(name, kind)
    w, before = packed(raw, name, shape), eight_bit(raw, name, shape)
    assert w.kind == TABLED[name] and w.bits == 4 and w.path == before.path
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


def test_mxfp4_experts_in_one_call_give_each_matrix_its_own_bits():
    """qmany's fused experts on MXFP4's table codes: three matrices' segments in one call, one activation
    row each (a decode step) and several, on every integer path this CPU has, bit for bit what each
    matrix's own product gives those rows."""
    raw, shape = blocks("MXFP4", "random")
    ws = [packed(np.roll(raw, i, axis=0), "MXFP4", shape) for i in range(3)]  # rows moved: other matrices
    x = torch.randn(6, shape[1], generator=torch.Generator().manual_seed(4))
    tiles = ws[0].codes.shape[0]
    segs = np.array([(0, 0, tiles, 0, 1), (1, 0, tiles, 1, 1), (2, 1, tiles, 2, 4)], np.int64)
    for path in [p for p in cpu.runnable_paths() if p != "float" and fits(p, "fp4")]:
        for w in ws:
            w.path = path
        assert qmany.one_kind(ws)
        got = qmany.gemm_segments(ws, x.numpy(), segs)
        for s, (i, t0, t1, r0, rows) in enumerate(segs):
            want = ws[i].matmul(x[r0:r0 + rows], path)[:, t0 * TILE:]
            assert torch.equal(torch.from_numpy(got[s, :rows, :want.shape[1]]), want), (path, s)
