"""A GGUF's quantized matrices as integer codes, exactly: what `--weights native` runs.

Each supported block type is taken apart into the codes u, one float32 scale (and minimum) per group
and the zero point of kernels/weights/qweight.py, such that  scale * (u - zero) (+ minimum), rounded as
float32 one operation at a time, is bit for bit what gguf-py's dequantization gives:

  Q8_0, Q5_0        d * q                 8-bit codes q + 128, groups of 32
  Q6_K              (d * sc) * q          8-bit codes q + 128, groups of 16 (its sub-blocks)
  Q5_1 / Q5_K       d * q + m / (d * sc) * q - dmin * m    8-bit affine codes, groups of 32
  Q4_0              d * q                 4-bit codes q + 8, groups of 32
  Q4_1 / Q4_K       d * q + m / (d * sc) * q - dmin * m    4-bit affine codes, groups of 32

The bit unpacking stays gguf-py's: a block's integer codes are read by dequantizing a copy whose
float16 scale is set to 1 and offset to 0 (and Q4_K's sub-block scales with its own
`get_scale_min`). Every tensor is checked against gguf-py's own dequantization before it is kept.
Float tensors (F32, F16, BF16) need no codes: native runs them as float32, as do block types not
listed here.
"""

from __future__ import annotations

import gguf
import numpy as np

from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.gguf_blocks import values as dequantize  # codes -> the float32 values they stand for

Q = gguf.GGMLQuantizationType
ONE, ZERO = np.array([1.0], np.float16).view(np.uint8), np.array([0.0], np.float16).view(np.uint8)
# type -> (bits, group, zero, offset of d, offset of the minimum or None)
SIMPLE = {Q.Q8_0: (8, 32, 128, 0, None), Q.Q5_0: (8, 32, 128, 0, None), Q.Q4_0: (4, 32, 8, 0, None),
          Q.Q4_1: (4, 32, 0, 0, 2), Q.Q5_1: (8, 32, 0, 0, 2)}
K_QUANTS = {Q.Q4_K: 4, Q.Q5_K: 8}  # d at 0, dmin at 2, 12 bytes of 6-bit sub-block scales and minimums at 4
SUPPORTED = tuple(t.name for t in (*SIMPLE, *K_QUANTS, Q.Q6_K))


def _blocks(data: np.ndarray, qtype) -> np.ndarray:
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    return np.array(data, dtype=np.uint8).reshape(-1, size)  # a copy: the probes write into it


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _probe(blocks: np.ndarray, qtype, set_one: tuple, set_zero: tuple) -> np.ndarray:
    """gguf-py's dequantization of the blocks with some float16 fields set to 1 and others to 0."""
    b = blocks.copy()
    for at in set_one:
        b[:, at:at + 2] = ONE
    for at in set_zero:
        b[:, at:at + 2] = ZERO
    return gguf.quants.dequantize(b, qtype).reshape(len(b), -1)


def decompose(data: np.ndarray, qtype, shape: tuple[int, int]):
    """(u (n, k) uint8, scale (n, groups) float32, minimum or None, zero, bits), or None for a type
    native does not hold as codes. shape: (out, in), the matrix as gguf-py dequantizes it."""
    n, k = shape
    if qtype in SIMPLE:
        bits, group, zero, d_at, m_at = SIMPLE[qtype]
        blocks = _blocks(data, qtype)
        q = _probe(blocks, qtype, (d_at,), () if m_at is None else (m_at,))  # (blocks, 32): q - zero, or q
        u = (q + (zero if m_at is None else 0)).astype(np.uint8)
        scale = _f16(blocks, d_at)[:, None]
        minimum = None if m_at is None else _f16(blocks, m_at)[:, None]
    elif qtype in K_QUANTS:
        bits, group, zero = K_QUANTS[qtype], 32, 0
        blocks = _blocks(data, qtype)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # (blocks, 8) each
        scq = _probe(blocks, qtype, (0,), (2,)).reshape(len(blocks), 8, 32)  # sc * q
        scf, mf = sc.astype(np.float32), m.astype(np.float32)
        u = np.divide(scq, scf[:, :, None], out=np.zeros_like(scq), where=scf[:, :, None] > 0).astype(np.uint8)
        scale = _f16(blocks, 0)[:, None] * scf  # as gguf-py: (d * sc) first
        minimum = -(_f16(blocks, 2)[:, None] * mf)
    elif qtype == Q.Q6_K:
        bits, group, zero = 8, 16, 128
        blocks = _blocks(data, qtype)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # (blocks, 16)
        scq = _probe(blocks, qtype, (208,), ()).reshape(len(blocks), 16, 16)  # sc * (q - 32)
        q = np.divide(scq, sc[:, :, None], out=np.zeros_like(scq), where=sc[:, :, None] != 0)
        u = (q + 128).astype(np.uint8)
        scale = _f16(blocks, 208)[:, None] * sc
        minimum = None
    else:
        return None
    u = u.reshape(n, k)
    scale = scale.reshape(n, k // group).astype(np.float32)
    minimum = None if minimum is None else minimum.reshape(n, k // group).astype(np.float32)
    return u, scale, minimum, zero, bits


def native_codes(name: str, data: np.ndarray, qtype, shape: tuple[int, int], want: np.ndarray):
    """decompose(), checked against `want` (gguf-py's float32 values): equal value for value (a zero's
    sign aside, which gguf-py takes from the scale of a sub-block whose scale is 0)."""
    parts = decompose(data, qtype, shape)
    if parts is None:
        return None
    if not np.array_equal(dequantize(parts[0], parts[1], parts[2], parts[3]), want):  # as numbers: -0 == 0
        raise LarqlError(f"{name}: its {qtype.name} codes do not reproduce gguf's dequantized values; "
                         "this GGUF cannot be converted for native weights")
    return parts
