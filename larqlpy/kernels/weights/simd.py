"""Integer dot products over one weight group, written as LLVM IR for numba (`@intrinsic`).

numba's loops do not reach the CPU's integer dot-product instructions: LLVM's vectoriser does not
turn a loop over bytes into AVX-512 VNNI's `vpdpbusd` (four u8 x s8 products summed into each 32-bit
lane) or AVX2's `vpmaddubsw` + `vpmaddwd`, and numba widens byte arithmetic to 64-bit lanes. These
intrinsics emit exactly those instructions (checked with `inspect_asm`, tests/test_kernels.py).

Each one computes, for the 64 output rows of one tile and a few activation rows, the exact int32 sums
    dot[m, r] = sum over the group's inputs j of  u[r, j] * xq[m, j]
with u the weight codes (unsigned bytes) and xq the int8 activations, and adds them, scaled, to the
float32 outputs (see _make). The codes' layouts, and how each is unpacked into bytes: codebytes.py.
Integer sums are exact, so every path that computes them gives the same numbers bit for bit.

Arguments (flat arrays and offsets into them): acc float32 and the offset of row m0's outputs (rows
64 apart); codes uint8 and the group's offset; x int32 (four int8 activations each), offset, row
stride; scale float32 (or float16 bits as uint16) and offset (the group's 64 scales), minimum likewise;
or scale and minimum int8 (a K-quant's sub-block values; uint8: both in one byte, Q2_K's) with outer
uint16 and the offset of their block's 64 float16 d, then 64 -dmin;
xs float32 and sxq int32
(per activation row and group), offset, row stride; zc, the codes' zero point on this path; affine
(whether minimum holds anything); ahead, how many bytes past the group's codes to prefetch (0:
none). `quads` (inputs / 4 in the group) and `rows` are fixed per intrinsic.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from larqlpy.kernels.weights.codebytes import I8, I16, I32, PLANES, ROWS, TABLES, code_bytes, fn, parts, span, splat
from larqlpy.kernels.weights.codebytes import EXPONENTS, exponent_floats
from larqlpy.kernels.weights.codebytes import LOW, high_at, layout_bits  # noqa: F401 - simd.* to the kernels' users


def _ptr(context, builder, aty, arr, offset, vty):
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [offset]), vty.as_pointer())


class _Args:
    """An intrinsic's arguments inside its codegen, and loads from its flat arrays (see the module's
    docstring for their order)."""

    def __init__(self, context, builder, arg_types, args, width):
        self.context, self.builder, self.ty = context, builder, arg_types
        self.exponents = width in EXPONENTS  # uint8 scales: exponent bytes, not Q2_K's joint nibbles
        (self.acc, self.aoff, self.codes, self.coff, self.x, self.xoff, self.xstride, self.scale, self.soff,
         self.minimum, self.outer, self.ooff, self.xs, self.sxq, self.qoff, self.qstride, self.zc, self.affine,
         self.ahead) = args
        self.idx = self.xoff.type

    def at(self, k: int, arr, off, n, vty, align=4):
        """A pointer to flat array k at off + n as `vty`, and what it holds."""
        b = self.builder
        p = _ptr(self.context, b, self.ty[k], arr, b.add(off, ir.Constant(self.idx, n)), vty)
        return p, b.load(p, align=align)

    def x_of(self, row: int, quad: int):
        """Four int8 activations of activation row `row` as one int32."""
        b = self.builder
        off = b.add(self.xoff, b.mul(self.xstride, ir.Constant(self.idx, row)))
        return self.at(4, self.x, off, quad, I32)[1]

    def codes_at(self, byte: int, vty):
        return self.at(2, self.codes, self.coff, byte, vty, align=1)[1]

    def floats(self, k: int, arr, n: int, fv):
        """A group's scales (k = 7) or minimums (k = 9) as float32 vectors: stored as float32, as
        float16 bits, or as a K-quant's int8 sub-block values times their block's float16 d (or -dmin)
        from `outer` (an exact product); uint8: Q2_K's scale (low nibble) and minimum (high) in the one
        byte the file holds them in, read from the scales for both (one load); or, for a table of
        codebytes.EXPONENTS, uint8 exponent bytes (MXFP4's, 2^(e - 128))."""
        b = self.builder
        if self.exponents and self.ty[k].dtype == types.uint8:
            return exponent_floats(b, self.at(k, arr, self.soff, n, ir.VectorType(I8, fv.count), align=1)[1], fv)
        if self.ty[k].dtype in (types.int8, types.uint8):
            bv = ir.VectorType(I8, fv.count)
            if self.ty[k].dtype == types.int8:
                ints = self.at(k, arr, self.soff, n, bv, align=1)[1]
            else:
                joint = self.at(7, self.scale, self.soff, n, bv, align=1)[1]
                ints = b.and_(b.lshr(joint, ir.Constant(bv, [4 if k == 9 else 0] * fv.count)),
                              ir.Constant(bv, [15] * fv.count))
            ints = b.sitofp(ints, fv)
            half = ir.VectorType(I16, fv.count)
            h = self.at(10, self.outer, self.ooff, (0 if k == 7 else ROWS) + n, half, align=2)[1]
            return b.fmul(b.fpext(b.bitcast(h, ir.VectorType(ir.HalfType(), fv.count)), fv), ints)
        if self.ty[k].dtype == types.uint16:
            h = self.at(k, arr, self.soff, n, ir.VectorType(I16, fv.count), align=2)[1]
            return b.fpext(b.bitcast(h, ir.VectorType(ir.HalfType(), fv.count)), fv)
        return self.at(k, arr, self.soff, n, fv)[1]


def _add_scaled(a: _Args, sums, affine: bool, registers: int, vectors) -> None:
    """Add each row's int32 sums (sums[row][i], of output vector vectors[i]), scaled, to its float32
    outputs.

    The scales and minimums are the same for every row: with registers to spare (AVX-512's 32)
    they are loaded once, and so is every output before the first store -- LLVM cannot move loads
    past stores into acc it cannot prove apart; AVX2's 16 registers would spill them, so there each
    is loaded where it is used."""
    b = a.builder
    width = sums[0][0].type.count
    fv = ir.VectorType(ir.FloatType(), width)
    n_rows = len(sums)
    early = registers >= 32
    scales = [a.floats(7, a.scale, v * width, fv) for v in vectors] if early else None
    mins = [a.floats(9, a.minimum, v * width, fv) for v in vectors] if early and affine else None
    rows = []
    for m in range(n_rows):
        q = b.add(a.qoff, b.mul(a.qstride, ir.Constant(a.idx, m)))
        rows.append((a.at(12, a.xs, q, 0, ir.FloatType())[1], a.at(13, a.sxq, q, 0, I32)[1]))
    olds = [[a.at(0, a.acc, a.aoff, m * ROWS + v * width, fv) for v in vectors] for m in range(n_rows)] \
        if early else None
    fma = fn(b, f"llvm.fma.v{width}f32", fv, [fv, fv, fv])
    for m in range(n_rows):
        c, s = rows[m]
        zs = splat(b, b.mul(a.zc, s), sums[m][0].type)
        cv = splat(b, c, fv)
        xsum = splat(b, b.fmul(c, b.sitofp(s, ir.FloatType())), fv)
        for i, (v, d) in enumerate(zip(vectors, sums[m])):
            f = b.fmul(cv, b.sitofp(b.sub(d, zs), fv))
            p, old = olds[m][i] if early else a.at(0, a.acc, a.aoff, m * ROWS + v * width, fv)
            new = b.call(fma, [scales[i] if early else a.floats(7, a.scale, v * width, fv), f, old])
            if affine:
                new = b.call(fma, [mins[i] if early else a.floats(9, a.minimum, v * width, fv), xsum, new])
            b.store(new, p, align=4)


@intrinsic
def prefetch(typingctx, arr, at):
    """A hint to bring the cache line holding byte `at` of `arr`'s data into every cache level (a
    prefetch never faults, so `at` may run past the end)."""
    def codegen(context, builder, signature, args):
        data = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, I8.as_pointer())
        _hint(builder, builder.gep(data, [args[1]]))
        return context.get_dummy_value()

    return types.void(arr, types.intp), codegen


def _hint(builder, at) -> None:
    """llvm.prefetch of the byte `at` points to: a read, into every cache level, of data."""
    hint = fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(hint, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _prefetch(a: "_Args", span: int) -> None:
    """Where `ahead` > 0: prefetch (into every cache level) the `span` bytes of codes `ahead` bytes past
    this group's (kernels/weights/prefetch.py says why and when)."""
    b = a.builder
    ahead = a.ahead
    with b.if_then(b.icmp_signed(">", ahead, ir.Constant(ahead.type, 0))):
        for line in range(0, span, 64):
            _hint(b, _ptr(a.context, b, a.ty[2], a.codes, b.add(a.coff, b.add(ahead, ir.Constant(a.idx, line))), I8))


def _make(emit, quads: int, width, widest: int, registers: int, first: int = 0):
    """An intrinsic that sums one group for its first argument's count of activation rows, 1 to
    `widest` (`emit`; a switch over the counts, each its own code), and adds the scaled sums to the
    float32 outputs, in registers:
        f = xs[m] * float(dot[m, r] - zc * sxq[m])
        acc[m, r] = fma(scale[r], f, acc[m, r])        (then fma(minimum[r], xs[m] * float(sxq[m]), acc[m, r]))
    with llvm.fma (one rounding each), in this order on every path, so the paths agree bit for bit.
    Up to BLOCK rows sum the whole tile at once; more rows sum it two output vectors at a time, each
    code vector still unpacked once for every row, so their sums and the activations stay in
    registers. `registers`: how many vector registers the instruction set has (what may be loaded
    early); first: codebytes.code_bytes'."""

    @intrinsic
    def dot(typingctx, rows, acc, aoff, codes, coff, x, xoff, xstride, scale, soff, minimum, outer, ooff, xs, sxq,
            qoff, qstride, zc, affine, ahead):
        sig = types.void(types.intp, acc, types.intp, codes, types.intp, x, types.intp, types.intp, scale, types.intp,
                         minimum, outer, types.intp, xs, sxq, types.intp, types.intp, types.int32, types.boolean,
                         types.intp)

        def codegen(context, builder, signature, args):
            a = _Args(context, builder, signature.args[1:], args[1:], width)
            _prefetch(a, quads // parts(width) * ROWS * span(width))
            flag = builder.icmp_unsigned("!=", a.affine, ir.Constant(a.affine.type, 0))
            done = builder.append_basic_block("rows_done")
            cases = builder.switch(args[0], done)
            for n in range(1, widest + 1):
                block = builder.append_basic_block(f"rows_{n}")
                cases.add_case(ir.Constant(args[0].type, n), block)
                builder.position_at_end(block)
                _sum_rows(a, emit, quads, width, n, registers, flag, first)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return dot


def _sum_rows(a: _Args, emit, quads: int, width, rows: int, registers: int, affine, first: int) -> None:
    """One group's sums for `rows` activation rows, added scaled to their outputs (`_make`)."""
    b, lanes = a.builder, 64 // emit.vectors
    per = emit.vectors if rows <= BLOCK else 2
    for vectors in [range(v, v + per) for v in range(0, emit.vectors, per)]:
        sums = emit(b, a.codes_at, a.x_of, quads, width, rows, vectors, lanes, first)  # sums[row][i], of vectors[i]
        with b.if_else(affine) as (with_minimum, without):
            with with_minimum:
                _add_scaled(a, sums, True, registers, vectors)
            with without:
                _add_scaled(a, sums, False, registers, vectors)


def _vnni512(builder, codes_at, x_of, quads, width, rows, vectors, lanes, first=0):
    """AVX-512 VNNI: 16 rows per zmm, one vpdpbusd per 16 rows x 4 inputs; each code vector loaded
    once for all the activation rows (of `vectors`, the tile's zmm of outputs this pass sums)."""
    v16 = ir.VectorType(I32, lanes)
    dp = fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
    acc = [[ir.Constant(v16, None)] * len(vectors) for _ in range(rows)]
    step = parts(width)  # activation quads a unit of codes covers
    for q in range(0, quads, step):
        xs = [[splat(builder, x_of(m, q + h), v16) for h in range(step)] for m in range(rows)]
        for i, v in enumerate(vectors):
            unpacked = code_bytes(builder, codes_at, width, q // step, v, lanes, first)
            for m in range(rows):
                for part, xb in zip(unpacked, xs[m]):
                    acc[m][i] = builder.call(dp, [acc[m][i], part, xb])
    return acc


_vnni512.vectors = 4


def _avx2(signed: bool):
    """AVX2: 8 rows per ymm; vpmaddubsw (u8 x s8 -> pairs of i16), vpmaddwd by ones (-> i32).

    vpmaddubsw saturates a pair above 32,767: codes up to 127 never reach it (2 x 127 x 127), and
    with `signed` the codes u in 1..255 are taken as u - 128 and the sign of the activation moved onto
    them (llama.cpp's trick), so the unsigned side is |x| <= 127. The caller adds 128 * sum(xq) back."""

    def emit(builder, codes_at, x_of, quads, width, rows, vectors, lanes, first=0):
        v8, b32, w16 = ir.VectorType(I32, lanes), ir.VectorType(I8, 32), ir.VectorType(I16, 16)
        maddubs = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [b32, b32])
        maddwd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [w16, w16])
        sign = fn(builder, "llvm.x86.avx2.psign.b", b32, [b32, b32])
        absb = fn(builder, "llvm.abs.v32i8", b32, [b32, ir.IntType(1)])
        ones = ir.Constant(w16, [1] * 16)
        acc = [[ir.Constant(v8, None)] * len(vectors) for _ in range(rows)]
        step = parts(width)  # activation quads a unit of codes covers
        for q in range(0, quads, step):
            xs = [[builder.bitcast(splat(builder, x_of(m, q + h), v8), b32) for h in range(step)] for m in range(rows)]
            ax = [[builder.call(absb, [xb, ir.Constant(ir.IntType(1), 0)]) for xb in row] for row in xs] \
                if signed else None
            for i, v in enumerate(vectors):
                unpacked = code_bytes(builder, codes_at, width, q // step, v, lanes, first, signed)
                for m in range(rows):
                    for h, (part, xb) in enumerate(zip(unpacked, xs[m])):
                        part = builder.bitcast(part, b32)
                        if signed:
                            pairs = builder.call(maddubs, [ax[m][h], builder.call(sign, [part, xb])])
                        else:
                            pairs = builder.call(maddubs, [part, xb])
                        acc[m][i] = builder.add(acc[m][i], builder.call(maddwd, [pairs, ones]))
        return acc

    emit.vectors = 8
    return emit


# (isa, bits, quads, first) -> intrinsic over 1 .. WIDEST[isa] rows; quads 8 = groups of 32 inputs, 4 =
# groups of 16 (Q6_K, Q2_K, Q3_K); first: where the group starts in its high words' span
# (codebytes.code_bytes: 0, or the unit a 5- or 3-bit group of 16 at an odd index starts at). VNNI
# sums up to BLOCK rows over a whole tile (32 zmm hold their sums) and more two output vectors at a
# time, each code vector unpacked once for them all; AVX2 takes PAIR rows (its 16 ymm hold one row's
# sums, so two spill, but each code byte is unpacked once for both: docs/weights.md has what it bought).
BLOCK = 4
PAIR = 2
WIDEST = {"vnni512": 8, "avx2": PAIR, "avx2-signed": PAIR}
WIDTHS = (8, 4, 5, 6, 2, 3, *TABLES)


def fits(isa: str, width) -> bool:
    """Whether `isa` sums codes of `width` exactly: AVX2's unsigned byte products saturate above 127
    (a table's codes are fixed: it fits where they all do), its signed form takes 8-bit codes and
    tables of codes 1..255 (cpu.int_path chooses among 8-bit codes by the range present)."""
    if isa == "avx2-signed":
        return width == 8 or (width in TABLES and TABLES[width].min() >= 1)
    return isa != "avx2" or width not in TABLES or TABLES[width].max() <= 127


def firsts(width, quads: int) -> tuple[int, ...]:
    """Where a group of `quads` may start within its high words' span of 8 / (P parts) units."""
    if width == 8 or not PLANES[width]:
        return (0,)
    return tuple(range(0, 8 // (PLANES[width] * parts(width)), max(1, quads // parts(width))))


DOTS = {(isa, bits, quads, first): _make(emit, quads, bits, WIDEST[isa], registers, first)
        for isa, emit, registers in (("vnni512", _vnni512, 32), ("avx2", _avx2(False), 16),
                                     ("avx2-signed", _avx2(True), 16))
        for bits in WIDTHS if fits(isa, bits) for quads in (8, 4) for first in firsts(bits, quads)}
