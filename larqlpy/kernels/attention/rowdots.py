"""Decode attention 16 rows at a time, written as LLVM IR for numba (`@intrinsic`): one query head's
scores over 16 float32 K rows, and its weighted sum of 16 float32 V rows; and the widening of 16
float16 or bfloat16 rows into float32, once for all the query heads that read them.

numba's loop over one row's dot product ends in a horizontal sum per row and query head, and its
loop over V rows stores and reloads the head's sums at every row. Here each of 16 K rows keeps a
vector of partial sums (one fused multiply-add per 16 elements, in element order), and the 16
vectors are summed across their lanes together, as a tree of shuffles and adds that leaves row
r's sum in lane r: 15 adds for 16 rows instead of 4 each. The V rows' weighted sums stay in
registers across the 16 rows. The order of every sum is fixed by this code, not by the compiler,
so every path through it gets the same bits. Figures: docs/benchmarks.md ("Decode attention").
The codec's kernel (tq_attend.py) runs the same two over blocks of 16 rows decoded from codes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32, F16, BF16 = 0, 1, 2  # a row's element kind (attention.py's where[s, 8]; tq_attend's decoded rows are F32)
LANES = 16
I16, I32, I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
FV = ir.VectorType(ir.FloatType(), LANES)


def _fn(builder, name: str, ret, args):
    try:
        return builder.module.get_global(name)
    except KeyError:
        return ir.Function(builder.module, ir.FunctionType(ret, args), name=name)


def _data(context, builder, aty, arr):
    return context.make_array(aty)(context, builder, arr).data


def _load(builder, base, offset, vty):
    p = builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())
    return builder.load(p, align=1)


def _widened(builder, base, offset, kind: int):
    """16 16-bit elements (kind F16 or BF16) of a row from `offset` as float32."""
    bits = _load(builder, base, offset, ir.VectorType(I16, LANES))
    if kind == F16:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), FV)
    shifted = builder.shl(builder.zext(bits, ir.VectorType(I32, LANES)), ir.Constant(ir.VectorType(I32, LANES), 16))
    return builder.bitcast(shifted, FV)


def lane_sums(builder, vectors: list):
    """16 vectors -> one whose lane r is the sum of vector r's lanes: pairs of vectors joined level by
    level (each row's lanes halved by adding its first half to its second), then put in row order."""
    items = [(v, [r] * LANES) for r, v in enumerate(vectors)]
    mask = ir.VectorType(I32, LANES)
    while len(items) > 1:
        joined = []
        for (x, mx), (y, my) in zip(items[0::2], items[1::2]):
            left, right, rows = [], [], []
            for shift, lanes_of in ((0, mx), (LANES, my)):
                for row in dict.fromkeys(lanes_of):
                    lanes = [j for j, r in enumerate(lanes_of) if r == row]
                    half = len(lanes) // 2
                    left += [shift + j for j in lanes[:half]]
                    right += [shift + j for j in lanes[half:]]
                    rows += [row] * half
            a = builder.shuffle_vector(x, y, ir.Constant(mask, left))
            b = builder.shuffle_vector(x, y, ir.Constant(mask, right))
            joined.append((builder.fadd(a, b), rows))
        items = joined
    v, rows = items[0]
    return builder.shuffle_vector(v, v, ir.Constant(mask, [rows.index(r) for r in range(LANES)]))


def _dot_body(builder, ptrs, args, d: int) -> None:
    """Emit `dot16` for one head size."""
    sc_p, q_p, src_p, at_p = ptrs
    fma = _fn(builder, f"llvm.fma.v{LANES}f32", FV, [FV, FV, FV])
    qv = [_load(builder, q_p, builder.add(args[3], ir.Constant(I64, c * LANES)), FV) for c in range(d // LANES)]
    sums = []
    for r in range(LANES):
        first = builder.mul(_row(builder, at_p, args[6], r), ir.Constant(I64, d))
        acc = None
        for c in range(d // LANES):
            x = _load(builder, src_p, builder.add(first, ir.Constant(I64, c * LANES)), FV)
            acc = builder.fmul(x, qv[c]) if acc is None else builder.call(fma, [x, qv[c], acc])
        sums.append(acc)
    out = builder.bitcast(builder.gep(sc_p, [args[1]]), FV.as_pointer())
    builder.store(builder.fmul(lane_sums(builder, sums), _splat(builder, args[8])), out, align=1)


def _sum_body(builder, ptrs, args, d: int) -> None:
    """Emit `sum16` for one head size."""
    acc_p, p_p, src_p, at_p = ptrs
    fma = _fn(builder, f"llvm.fma.v{LANES}f32", FV, [FV, FV, FV])
    spots = [builder.add(args[1], ir.Constant(I64, c * LANES)) for c in range(d // LANES)]
    sums = [_load(builder, acc_p, spot, FV) for spot in spots]
    for r in range(LANES):
        first = builder.mul(_row(builder, at_p, args[6], r), ir.Constant(I64, d))
        w = _splat(builder, builder.load(builder.gep(p_p, [builder.add(args[3], ir.Constant(I64, r))])))
        for c in range(d // LANES):
            x = _load(builder, src_p, builder.add(first, ir.Constant(I64, c * LANES)), FV)
            sums[c] = builder.call(fma, [w, x, sums[c]])
    for spot, v in zip(spots, sums):
        builder.store(v, builder.bitcast(builder.gep(acc_p, [spot]), FV.as_pointer()), align=1)


def _row(builder, at_p, i, r: int):
    return builder.load(builder.gep(at_p, [builder.add(i, ir.Constant(I64, r))]))


def _splat(builder, x):
    v = builder.insert_element(ir.Constant(FV, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(FV, ir.Undefined), ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))


HEAD_DIMS = (64, 128, 256)  # the head sizes done here; others take the callers' loops


@njit(inline="always", cache=True, error_model="numpy")
def blocked(d):  # pragma: no cover - jitted
    """Whether head size d is one of HEAD_DIMS (folded away where d is a literal)."""
    return d == 64 or d == 128 or d == 256


def _cases(builder, key, cases) -> None:
    """A switch on key (i64) to one block per (value, emit) of `cases`, each emitting its code, then
    joining after: LLVM folds it to one case where key is a constant."""
    end = builder.append_basic_block("end")
    switch = builder.switch(key, end)
    for value, emit in cases:
        block = builder.append_basic_block(f"case{value}")
        switch.add_case(ir.Constant(I64, value), block)
        with builder.goto_block(block):
            emit()
            builder.branch(end)
    builder.position_at_end(end)


def _intrinsic(body, with_scale: bool):
    """An intrinsic (out, out_off, x, x_off, rows, at, i, d[, scale]) over float32 rows whose code for
    each head size is `body`, chosen by a switch LLVM folds away where d is a constant."""

    def typer(typingctx, out, out_off, x, x_off, rows, at, i, d, scale=None):
        tail = (types.float32,) if with_scale else ()
        sig = types.void(out, types.intp, x, types.intp, rows, at, types.intp, types.int64, *tail)

        def codegen(context, builder, signature, args):
            ptrs = tuple(_data(context, builder, signature.args[k], args[k]) for k in (0, 2, 4, 5))
            _cases(builder, args[7], [(d, lambda d=d: body(builder, ptrs, args, d)) for d in HEAD_DIMS])
            return context.get_dummy_value()

        return sig, codegen

    if with_scale:
        return intrinsic(lambda typingctx, out, out_off, x, x_off, rows, at, i, d, scale:
                         typer(typingctx, out, out_off, x, x_off, rows, at, i, d, scale))
    return intrinsic(lambda typingctx, out, out_off, x, x_off, rows, at, i, d:
                     typer(typingctx, out, out_off, x, x_off, rows, at, i, d))


def _widen_body(builder, out_p, src_p, at_p, i, kind: int, d: int) -> None:
    """Emit `widen16` for one element kind and head size."""
    for r in range(LANES):
        first = builder.mul(_row(builder, at_p, i, r), ir.Constant(I64, d))
        for c in range(d // LANES):
            x = _widened(builder, src_p, builder.add(first, ir.Constant(I64, c * LANES)), kind)
            spot = builder.gep(out_p, [ir.Constant(I64, r * d + c * LANES)])
            builder.store(x, builder.bitcast(spot, FV.as_pointer()), align=1)


@intrinsic
def widen16(typingctx, out, rows16, at, i, kind, d):
    """widen16(out, rows16, at, i, kind, d): out (16, d) float32 = 16-bit rows at[i + r] of rows16, r <
    16 (kind F16 or BF16, d one of HEAD_DIMS: a switch LLVM folds where they are constants). Exact, so
    the rows score as their 16-bit selves do; done once a block, not once a query head."""
    sig = types.void(out, rows16, at, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        out_p, src_p, at_p = (_data(context, builder, signature.args[k], args[k]) for k in (0, 1, 2))

        def case(kind: int, d: int):
            return kind * 4096 + d, lambda: _widen_body(builder, out_p, src_p, at_p, args[3], kind, d)

        key = builder.add(builder.mul(args[4], ir.Constant(I64, 4096)), args[5])
        _cases(builder, key, [case(kind, d) for kind in (F16, BF16) for d in HEAD_DIMS])
        return context.get_dummy_value()

    return sig, codegen


# dot16(sc, sc_off, q, q_off, k, at, i, d, scale): sc.flat[sc_off + j] = scale * (q.flat[q_off:q_off + d] .
# float32 K row at[i + j]) for j < 16
dot16 = _intrinsic(_dot_body, True)
# sum16(acc, acc_off, p, p_off, v, at, i, d): acc.flat[acc_off:acc_off + d] += sum over j < 16, in order,
# of p.flat[p_off + j] * float32 V row at[i + j]
sum16 = _intrinsic(_sum_body, False)
