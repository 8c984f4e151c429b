"""Scalar helpers the CPU kernels inline: addresses as pointers, 16-bit floats' bits, an
exponential LLVM vectorizes, and a float32 dot product."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from larqlpy.kernels import jitcache
from larqlpy.kernels.jitcache import FASTMATH


def pointer_to(element):
    """An intrinsic taking an int64 address to a pointer to `element`s (for numba.carray): rows that
    live in a store's tensor."""
    @intrinsic
    def at(typingctx, address):
        sig = types.CPointer(element)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return at


f32_at = pointer_to(types.float32)  # f32 rows
u16_at = pointer_to(types.uint16)  # 16-bit rows: f16 / bf16 bits


@intrinsic
def from_half(typingctx, bits):
    """f16 bits -> float32 (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def to_half(typingctx, x):
    """float32 -> f16 bits, rounded to nearest even (what torch's .half() gives)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def float_bits(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_float(typingctx, bits):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def exp(x):  # pragma: no cover - jitted
    """e^x for x <= 88 in arithmetic LLVM vectorizes (libm's expf is a call per value): Cephes' expf,
    a degree-6 polynomial after reduction by ln 2, within 2 ulp; below -87, about 0."""
    x = max(x, np.float32(-87.0))
    n = np.rint(x * np.float32(1.4426950408889634))
    r = (x - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * bits_float(np.uint32((np.int32(n) + 127) << 23))


@njit(inline="always", cache=True, error_model="numpy")
def from_bf16(bits):  # pragma: no cover - jitted
    return bits_float(np.uint32(bits) << np.uint32(16))


@njit(inline="always", cache=True, error_model="numpy")
def to_bf16(x):  # pragma: no cover - jitted
    """float32 -> bf16 bits, rounded to nearest even with NaN kept a NaN (torch's rounding)."""
    if x != x:
        return np.uint16(0x7FC0)
    b = np.int64(float_bits(x))
    return np.uint16(((b + ((b >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF)


@njit(inline="always", fastmath=FASTMATH, cache=True, error_model="numpy")
def dot(a, b):  # pragma: no cover - jitted
    """Two float32 rows' dot product, summed in float32 (fastmath: LLVM vectorizes the sum)."""
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


jitcache.tie(globals(), jitcache)  # compiled with its FASTMATH
