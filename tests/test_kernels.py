"""The CPU kernel paths (kernels/weights/qdot.py, simd.py): every path this CPU can run, forced, against a
float64 reference of the same packed weights; the integer paths against each other; the activation
rounding they share; the instructions they compile to; and decode attention over many sequences."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import njit

from larqlpy.kernels.weights import choice, prefetch, qdot
from larqlpy.kernels import cpu
from larqlpy.kernels.attention.decode import Span, attend_one, attend_rows
from larqlpy.kernels.weights.matvec import gemv_f32
from larqlpy.kernels.weights.qweight import TILE, PackedWeight

HERE = cpu.runnable_paths()
ROOT = Path(__file__).resolve().parent.parent


def rand_codes(bits, n=2 * TILE + 5, k=128, group=32, affine=False, zero=None, lo=None, hi=None, seed=0,
               half=False):
    rng = np.random.default_rng(seed)
    lo = (1 if bits == 8 else 0) if lo is None else lo
    hi = 2 ** bits - 1 if hi is None else hi
    u = rng.integers(lo, hi + 1, (n, k)).astype(np.uint8)
    scale = (rng.random((n, k // group)) * 0.01).astype(np.float32)
    minimum = ((rng.random((n, k // group)) - 0.5) * 0.1).astype(np.float32) if affine else None
    zero = (0 if affine else 8 if bits == 4 else 128) if zero is None else zero
    if half:  # float16 values: packed as float16 bits
        scale = scale.astype(np.float16).astype(np.float32)
        minimum = None if minimum is None else minimum.astype(np.float16).astype(np.float32)
    p = PackedWeight.from_codes(u, scale, minimum, zero, bits)
    assert (p.scale.dtype == torch.int16) == half
    return u, scale, minimum, zero, p


def weights64(u, scale, minimum, zero):
    group = u.shape[1] // scale.shape[1]
    w = np.repeat(scale.astype(np.float64), group, 1) * (u.astype(np.float64) - zero)
    return w if minimum is None else w + np.repeat(minimum.astype(np.float64), group, 1)


def rounded_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x^: each group of `group` values rounded to int8 steps of max|x| / 127, computed independently."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float32)
    amax = np.abs(g).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        q = np.clip(np.rint(g * np.where(amax > 0, np.float32(127) / amax, 0)), -127, 127)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def paths_for(p: PackedWeight) -> list[str]:
    ok = ["float"]
    if "vnni512" in HERE:
        ok.append("vnni512")
    if "avx2" in HERE:
        if p.bits != 8 or p.highest <= 127:
            ok.append("avx2")
        if p.bits == 8 and p.lowest >= 1:
            ok.append("avx2-signed")
    return ok


CASES = {  # name -> rand_codes arguments: every format the packers and the GGUF decomposition make
    "int8, Q8_0 (float16 scales)": dict(bits=8, half=True),
    "8-bit, float32 scales": dict(bits=8),
    "Q5_0 as 8-bit": dict(bits=8, lo=112, hi=143),
    "Q6_K, groups of 16": dict(bits=8, group=16, lo=96, hi=159),
    "8-bit affine (Q5_1, Q5_K)": dict(bits=8, affine=True, lo=0, hi=31),
    "codes below 128": dict(bits=8, lo=0, hi=127),
    "int4, Q4_1 (float16 scales and minimums)": dict(bits=4, affine=True, half=True),
    "Q4_K (float32)": dict(bits=4, affine=True),
    "Q4_0": dict(bits=4, half=True),
    "Q5_0 at 5 bits": dict(bits=5, zero=16, half=True),
    "Q5_1 at 5 bits": dict(bits=5, affine=True, half=True),
    "Q5_K at 5 bits (float32)": dict(bits=5, affine=True),
    "Q6_K at 6 bits, groups of 16": dict(bits=6, group=16, zero=32),
    "u5 in groups of 16": dict(bits=5, group=16, zero=16),  # odd groups: their high words lie before them
    "6 bits, groups of 32": dict(bits=6, zero=32, half=True),
}


HEAVY = pytest.mark.heavy  # a second group size of 6 and 3 bits: the suite's 30 minutes


@pytest.mark.parametrize("bits, base, zero, group, affine", [
    (5, 112, 16, 32, False), (5, 0, 0, 32, True), (5, 112, 16, 16, False), (6, 96, 32, 16, False),
    pytest.param(6, 96, 32, 32, False, marks=HEAVY), (2, 0, 0, 16, True), (3, 0, 4, 16, False),
    pytest.param(3, 0, 4, 32, False, marks=HEAVY)])
def test_narrow_codes_give_the_bits_of_their_8_bit_form(bits, base, zero, group, affine):
    """A GGUF's 2-, 3-, 5- and 6-bit codes run at their own width, less the base their 8-bit form adds:
    the integer sums are the same integers, so every path gives the same bits as the 8-bit codes do."""
    u, scale, minimum, zero, narrow = rand_codes(bits, group=group, zero=zero, affine=affine, half=True)
    wide = PackedWeight.from_codes(u + np.uint8(base), scale, minimum, zero + base, 8)
    assert narrow.kind == f"u{bits}" and narrow.nbytes < wide.nbytes
    idx = torch.tensor([0, 5, TILE, 2 * TILE + 4])
    assert torch.equal(narrow.rows(idx), wide.rows(idx)) and torch.equal(narrow._rows_torch(idx), wide.rows(idx))
    x = torch.randn(6, u.shape[1], generator=torch.Generator().manual_seed(1))
    for path in paths_for(narrow):  # the float GEMV sums codes times x in floats: close, not the same bits
        if path in paths_for(wide):
            got, want = narrow.matmul(x, path=path), wide.matmul(x, path=path)
            assert torch.equal(got, want) if path != "float" else torch.allclose(got, want, rtol=1e-5, atol=1e-5), path
    big = torch.randn(40, u.shape[1])  # dequantized slabs: the same values, the same GEMM
    assert torch.equal(narrow.matmul(big, path="float"), wide.matmul(big, path="float"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 5, pytest.param(9, marks=pytest.mark.heavy), 40])  # 9: the suite's budget
def test_every_path_against_float64(case, rows):
    u, scale, minimum, zero, p = rand_codes(**CASES[case])
    w = weights64(u, scale, minimum, zero)
    x = torch.randn(rows, u.shape[1], generator=torch.Generator().manual_seed(rows))
    exact, rounded = x.double().numpy() @ w.T, rounded_activations(x.numpy(), p.group) @ w.T
    results = {}
    for path in paths_for(p):
        got = p.matmul(x, path=path).double().numpy()
        assert got.shape == (rows, u.shape[0])
        want = exact if path == "float" else rounded  # integer paths multiply x^, float paths x itself
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), path
        results[path] = got
    ints = [r for path, r in results.items() if path != "float"]
    for other in ints[1:]:  # exact int32 sums, the same float steps: bit for bit
        assert np.array_equal(ints[0], other)


@pytest.mark.parametrize("case", ["Q4_K (float32)", "Q5_0 at 5 bits", "Q6_K at 6 bits, groups of 16",
                                  "int8, Q8_0 (float16 scales)"])
def test_prefetching_ahead_changes_no_number(case):
    u, scale, minimum, zero, p = rand_codes(**CASES[case], n=6 * TILE)
    x = torch.randn(5, u.shape[1], generator=torch.Generator().manual_seed(3))
    for path in [q for q in paths_for(p) if q != "float"]:
        plain = [p.matmul(x[:rows], path=path) for rows in (1, 5)]
        p.ahead = 1024
        assert all(torch.equal(p.matmul(x[:rows], path=path), want) for rows, want in zip((1, 5), plain)), path
        p.ahead = 0


@pytest.mark.skipif(not {"vnni512", "avx2"} & set(HERE), reason="no integer path on this CPU")
def test_the_prefetch_distance_is_measured_once_per_machine_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(choice, "_memo", {})
    small = rand_codes(4, affine=True, seed=5)[-1]
    small.ahead = 4096
    assert prefetch.choose([small]) == {"codes": 0} and small.ahead == 0  # in any cache: nothing measured
    assert not (tmp_path / "larqlpy" / "kernel-choices.json").exists()
    monkeypatch.setattr(prefetch, "MEASURED_BYTES", 0)
    ws = [rand_codes(4, affine=True, seed=s)[-1] for s in range(3)]
    best = prefetch.choose(ws)["codes"]
    assert best in prefetch.AHEADS and all(w.ahead == best for w in ws)
    stored = json.loads((tmp_path / "larqlpy" / "kernel-choices.json").read_text())
    assert [k.rsplit(" | ", 1)[1] for k in stored] == ["codes prefetched ahead, cached weights"]
    monkeypatch.setattr(choice, "_memo", {})  # a new process: read back, not measured again
    fresh = rand_codes(4, affine=True, seed=9)[-1]
    fresh.matmul = lambda *a, **k: pytest.fail("measured again")
    assert prefetch.choose([fresh]) == {"codes": best} and fresh.ahead == best
    bf16 = PackedWeight.quantize(torch.randn(3 * TILE, 96), "bf16")
    x = torch.randn(1, 96)
    want = bf16.matmul(x)
    assert set(prefetch.choose([bf16])) == {"bf16 rows"} and torch.equal(bf16.matmul(x), want)
    bf16.ahead = 4096
    assert torch.equal(bf16.matmul(x), want)


@pytest.mark.parametrize("case", ["Q4_K (float32)", "Q6_K at 6 bits, groups of 16", "int8, Q8_0 (float16 scales)"])
def test_a_row_gives_the_same_numbers_alone_or_among_many(case):
    """Prefill in chunks and decode token by token meet the same numbers on the integer paths, with
    the rows taken in a call of any count the intrinsics take at once (simd.WIDEST) and past it."""
    u, scale, minimum, zero, p = rand_codes(**CASES[case])
    x = torch.randn(23, u.shape[1])
    for path in [q for q in paths_for(p) if q != "float"]:
        alone = torch.cat([p.matmul(x[i:i + 1], path=path) for i in range(23)])
        for m in [*range(2, 11), 23]:
            assert torch.equal(p.matmul(x[:m], path=path), alone[:m]), (path, m)


def test_activation_rounding_is_within_half_a_step():
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32) * 3
    x[2, :32] = 0.0  # an all-zero group: no NaN
    xq, xs, sxq = np.empty((5, 96), np.int8), np.empty((5, 3), np.float32), np.empty((5, 3), np.int32)
    qdot.quantize_activations(x, 32, xq, xs, sxq)
    back = xq.astype(np.float64) * np.repeat(xs, 32, 1)
    assert np.all(np.abs(back - x) <= np.repeat(xs, 32, 1) / 2 * (1 + 1e-6) + 1e-12)
    assert np.array_equal(sxq, xq.reshape(5, 3, 32).astype(np.int32).sum(-1))
    assert np.array_equal(back, rounded_activations(x, 32))
    many = np.tile(x, (8, 1))  # past the threaded cut-over: the same rounding
    mq, ms, msum = np.empty((40, 96), np.int8), np.empty((40, 3), np.float32), np.empty((40, 3), np.int32)
    qdot.quantize_activations(many, 32, mq, ms, msum)
    assert np.array_equal(mq[:5], xq) and np.array_equal(ms[:5], xs)


def test_the_default_path_is_the_fastest_this_cpu_runs():
    for bits, lo, hi in ((8, 1, 255), (8, 0, 255), (8, 0, 127), (4, 0, 15), (5, 0, 31), (6, 0, 63)):
        path = cpu.int_path(bits, lo, hi)
        assert path in HERE
        if "vnni512" in HERE:
            assert path == "vnni512"
        elif "avx2" in HERE:
            assert path == {(8, 1, 255): "avx2-signed", (8, 0, 255): "float"}.get((bits, lo, hi), "avx2")


@pytest.mark.parametrize("path, instruction, bits", [("vnni512", "vpdpbusd", 8), ("avx2", "vpmaddubsw", 8),
                                                     ("avx2-signed", "vpsignb", 8), ("vnni512", "vpdpbusd", 5),
                                                     ("avx2", "vpmaddubsw", 6)])
def test_the_kernels_compile_to_the_integer_dot_instructions(path, instruction, bits):
    if path not in HERE:
        pytest.skip(f"this CPU has no {path}")
    kernel = njit(parallel=True, error_model="numpy")(qdot.INT[(path, bits)].py_func)  # fresh: cached code has no asm
    u, scale, minimum, zero, p = rand_codes(bits, lo=1, hi=min(127, 2 ** bits - 1), zero=2 ** (bits - 1))
    x = np.zeros((1, u.shape[1]), np.float32)
    kernel(*p.arrays, np.int32(zero), x, np.empty((1, p.codes.shape[0] * TILE), np.float32), 4096, qdot.SLOTS)
    asm = "\n".join(kernel.inspect_asm(sig) for sig in kernel.signatures)
    assert instruction in asm and "prefetcht0" in asm


@pytest.mark.parametrize("path", ["numba", "torch"])
def test_both_f32_gemv_paths_against_float64(path):
    w, x = torch.randn(300, 96), torch.randn(1, 96)
    want = (x.double() @ w.double().T).float()
    assert torch.allclose(gemv_f32(x, w, path), want, atol=1e-5, rtol=1e-4)


def test_the_f32_gemv_choice_is_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(choice, "_memo", {})
    calls = []
    first = choice.choose("test shape", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    assert first in ("a", "b") and calls.count("a") == calls.count("b") > 1
    stored = json.loads((tmp_path / "larqlpy" / "kernel-choices.json").read_text())
    assert list(stored.values()) == [first]
    monkeypatch.setattr(choice, "_memo", {})  # a new process: read back, not measured again
    calls.clear()
    assert choice.choose("test shape", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}) == first
    assert calls == []


def _attention64(q, k, v, scale, softcap=0.0):
    """q (H, D) over k, v (Hkv, N, D) in float64."""
    group = q.shape[0] // k.shape[0]
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hn,hnd->hd", s.softmax(-1), vv)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_decode_attention_of_many_sequences_in_one_call(softcap):
    """attend_rows: each sequence's query over its own rows -- views into a store's larger buffers,
    2 KV heads apart by the buffer's capacity, 1 to 1,000 rows (one chunk and many) -- agrees with
    float64, and gives the bits it gives that sequence alone (the parallel and the one-chunk kernels alike)."""
    g = torch.Generator().manual_seed(3)
    lengths = [1, 7, 128, 129, 300, 1000, 64]
    bufs = [(torch.randn(2, 1100, 64, generator=g) * 2, torch.randn(2, 1100, 64, generator=g)) for _ in lengths]
    rows = [(k[:, 9:9 + n], v[:, 9:9 + n]) for (k, v), n in zip(bufs, lengths)]  # strided views, as Rows.read gives
    q = torch.randn(len(lengths), 8, 64, generator=g)
    together = attend_rows(q, [Span(k, v, 0, k.shape[1]) for k, v in rows], 0.125, softcap)
    for s, (k, v) in enumerate(rows):
        want = _attention64(q[s], k, v, 0.125, softcap)
        assert (together[s].double() - want).abs().max() < 1e-5
        assert torch.equal(attend_rows(q[s:s + 1], [Span(k, v, 0, k.shape[1])], 0.125, softcap)[0], together[s])
        kb, vb = bufs[s]  # the same rows addressed in the whole buffer
        assert torch.equal(attend_rows(q[s:s + 1], [Span(kb, vb, 9, lengths[s])], 0.125, softcap)[0], together[s])
        assert torch.equal(attend_one(q[s].unsqueeze(1), k.contiguous(), v.contiguous(), 0.125, softcap)[:, 0],
                           together[s])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_decode_attention_at_every_head_size_and_row_dtype(dtype, d):
    """Head sizes of 64, 128 and 256 are scored and summed 16 rows at a time (rowdots.py), others
    two rows at a time: over 16-bit and float32 rows, and row counts that are and are not a multiple
    of 16 (a chunk's padding adds nothing), each agrees with float64 over the rows as stored, and
    gives in a batch the bits it gives alone."""
    g = torch.Generator().manual_seed(d)
    lengths = [1, 17, 128, 300]
    rows = [(torch.randn(2, n, d, generator=g).to(dtype), torch.randn(2, n, d, generator=g).to(dtype))
            for n in lengths]
    q = torch.randn(len(lengths), 6, d, generator=g)
    scale = d ** -0.5
    together = attend_rows(q, [Span(k, v, 0, k.shape[1]) for k, v in rows], scale)
    for s, (k, v) in enumerate(rows):
        want = _attention64(q[s], k.float(), v.float(), scale, 0.0)
        assert (together[s].double() - want).abs().max() < 1e-5, lengths[s]
        assert torch.equal(attend_rows(q[s:s + 1], [Span(k, v, 0, k.shape[1])], scale)[0], together[s])


@pytest.mark.parametrize("n", [7, 128, 300])
def test_wide_heads_split_over_work_items_keep_each_heads_bits(n):
    """Latent attention's shape (16 query heads of 576 on one KV head, f16 rows): the heads are split
    over work items (chunk.parts), so a short sequence spreads over the threads; each head's numbers
    agree with float64 and are the bits that head gets alone (one item), on the one-chunk, serial and
    parallel kernels alike."""
    g = torch.Generator().manual_seed(n)
    k = torch.randn(1, n, 576, generator=g).to(torch.float16)
    q = torch.randn(1, 16, 576, generator=g)
    together = attend_rows(q, [Span(k, k, 0, n)], 0.05)[0]
    assert (together.double() - _attention64(q[0], k.float(), k.float(), 0.05)).abs().max() < 1e-5
    for h in range(16):
        assert torch.equal(attend_rows(q[:, h:h + 1], [Span(k, k, 0, n)], 0.05)[0, 0], together[h]), h


@pytest.mark.parametrize("split", [128, 256, 77, 1])
def test_a_query_over_pieces_of_rows_is_one_sequence(split):
    """A branch's query reads its prompt's shared rows, then its own (two buffers): split at a whole
    chunk, the same bits as over the rows in one buffer; anywhere else, the same numbers (float64);
    beside other sequences in one call, the bits it gets alone."""
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(2, 500, 64, generator=g), torch.randn(2, 500, 64, generator=g)
    shared, own = (k[:, :split], v[:, :split]), (k[:, split:].clone(), v[:, split:].clone())
    q = torch.randn(2, 8, 64, generator=g)
    whole = attend_rows(q[:1], [Span(k, v, 0, 500)], 0.125)
    pieces = (Span(*shared, 0, split), Span(*own, 0, 500 - split))
    got = attend_rows(q[:1], [pieces], 0.125)
    assert (got[0].double() - _attention64(q[0], k, v, 0.125, 0.0)).abs().max() < 1e-5
    if split % 128 == 0:
        assert torch.equal(got, whole)
    other = Span(k[:, :50], v[:, :50], 0, 50)
    both = attend_rows(q, [pieces, other], 0.125)
    assert torch.equal(both[0], got[0]) and torch.equal(both[1], attend_rows(q[1:], [other], 0.125)[0])


@pytest.mark.parametrize("first, n", [(0, 1), (5, 40), (290, 200), (299, 300), (100, 300)])
def test_decode_attention_writes_the_new_row_and_reads_a_ring_in_position_order(first, n):
    """A span the kernel writes: the step's own K, V (a column of the step's block) lands in the
    buffer row after the other n - 1, wrapping at the ring's 300 rows; the query reads the n rows in
    position order, the same bits as over a contiguous copy of them."""
    g = torch.Generator().manual_seed(5)
    ring = 300
    kb, vb = torch.randn(2, ring, 64, generator=g), torch.randn(2, ring, 64, generator=g)
    new_k, new_v = torch.randn(2, 3, 64, generator=g), torch.randn(3, 2, 64, generator=g).transpose(0, 1)  # v: a view
    slots = [(first + i) % ring for i in range(n)]
    q = torch.randn(1, 8, 64, generator=g)
    got = attend_rows(q, [Span(kb, vb, first, n, ring, write=True)], 0.125, 0.0, (new_k, new_v), [1])
    assert torch.equal(kb[:, slots[-1]], new_k[:, 1]) and torch.equal(vb[:, slots[-1]], new_v[:, 1])
    k, v = kb[:, slots].contiguous(), vb[:, slots].contiguous()
    assert torch.equal(got, attend_rows(q, [Span(k, v, 0, n)], 0.125))
    assert (got[0].double() - _attention64(q[0], k, v, 0.125)).abs().max() < 1e-5


CALLEE = "from numba import njit\n\n@njit(cache=True)\ndef f():\n    return {value}\n"
CALLER = """import sys
from numba import njit
import callee
{tie}
@njit(cache=True)
def g():
    return callee.f() + 1
{call_tie}
print(g())
"""


@pytest.mark.parametrize("tied", [False, True])
def test_a_kernels_cache_follows_the_modules_it_calls(tmp_path, tied):
    """numba keys a cached kernel on its own file only: after an edit to a module it calls, it loads
    compiled from the old code (the untied case shows it); jitcache.tie drops it, and it compiles afresh."""
    (tmp_path / "callee.py").write_text(CALLEE.format(value=1))
    (tmp_path / "caller.py").write_text(CALLER.format(
        tie="from larqlpy.kernels import jitcache" if tied else "",
        call_tie="jitcache.tie(globals(), callee)" if tied else ""))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def g() -> int:
        r = subprocess.run([sys.executable, str(tmp_path / "caller.py")], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return int(r.stdout)

    assert g() == 2
    time.sleep(0.01)
    (tmp_path / "callee.py").write_text(CALLEE.format(value=10))  # f's own cache follows its file; g's does not
    assert g() == (11 if tied else 2)


MOVED = """import sys
from numba import njit
from larqlpy.kernels import jitcache
import helper

@njit(cache=True)
def g():
    return helper.f() + 1

jitcache.tie(globals(), helper)
print(g(), sum(g.stats.cache_hits.values()))
"""


def test_a_moved_kernel_module_compiles_once_at_its_new_place(tmp_path):
    """numba keys a kernel's cache on its file's place: a kernel module moved to another folder (as the
    kernels' families were) compiles afresh once there, its tie to the module it inlines kept, and is
    loaded from the cache after; what was cached at the old place is never read."""
    (tmp_path / "helper.py").write_text(CALLEE.format(value=1))
    old, new = tmp_path / "kernels", tmp_path / "kernels" / "family"
    new.mkdir(parents=True)
    (old / "k.py").write_text(MOVED)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def g(where: Path) -> tuple[int, int]:
        r = subprocess.run([sys.executable, str(where / "k.py")], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        value, hits = r.stdout.split()
        return int(value), int(hits)

    assert g(old) == (2, 0) and g(old) == (2, 1)  # compiled, then loaded
    (old / "k.py").rename(new / "k.py")
    time.sleep(0.01)
    (tmp_path / "helper.py").write_text(CALLEE.format(value=10))  # the old place's cache holds 2
    assert g(new) == (11, 0)  # compiled afresh at the new place, from the code as it is now
    assert g(new) == (11, 1)  # and loaded from there after
