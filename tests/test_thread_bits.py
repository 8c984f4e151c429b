"""No number of our kernels follows the thread count: the numba products, attention, and a greedy
decode of the reference models, give the same bits on 1 thread as on 2 (kernels/threads.py). torch's
own float32 GEMM (MKL) is not held to it: its strict reproducible mode parted a kept state's answer
from a whole prefill's (docs/weights.md)."""

from __future__ import annotations

import os

import numba
import numpy as np
import pytest
import torch
from numba import njit, prange

from larqlpy.config import GenerationConfig
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.engines import EngineSpec, preset_spec
from larqlpy.engines.presets import RECOMMENDED
from larqlpy.kernels import cpu, threads, workshare
from larqlpy.kernels.attention.decode import Span, attend_rows
from larqlpy.kernels.weights import choice, matvec
from larqlpy.kernels.weights.qweight import GEMV_ROWS, PackedWeight
from larqlpy.weights.loader import load

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or numba.config.NUMBA_NUM_THREADS < 2,
                                reason="needs 2 CPUs")
ROOT = os.path.join(os.path.dirname(__file__), "..")
# (out, in): the 135M's and the 0.5B's products, a vocabulary-sized head among them
SHAPES = [(1536, 576), (576, 1536), (896, 896), (4864, 896), (896, 4864), (49152, 576)]


@pytest.fixture(autouse=True)
def counts():
    """Leave torch's and numba's thread counts as they were."""
    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def on_threads(fn, twos: int = 1) -> list:
    """fn's result on 1 thread, then on 2 (`twos` times: the threads take chunks in whatever order
    their timing gives, kernels/workshare.py)."""
    got = []
    for n in (1, *[2] * twos):
        torch.set_num_threads(n)
        numba.set_num_threads(n)
        got.append(fn())
    return got


def same(runs) -> bool:
    a, *others = runs
    return all(torch.equal(a, b) for b in others)


def test_float_products_on_numba():
    """numba's row-parallel loops: one row, and a batch step's few rows."""
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g)
        for m in (1, 3, 8, 17):
            x = torch.randn(m, k, generator=g)
            if m <= matvec.FEW_ROWS:
                numba_path = matvec.gemv_f32 if m == 1 else matvec.gemm_few_f32
                assert same(on_threads(lambda: numba_path(x, w, "numba"), 3)), ("numba", n, k, m)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_packed_products_on_every_path(fmt):
    g = torch.Generator().manual_seed(1)
    p = PackedWeight.quantize(torch.randn(4864, 896, generator=g), fmt)
    paths = [q for q in cpu.runnable_paths() if q != "avx2-signed"] if fmt != "bf16" else [None]
    for m in (1, 5, 40):
        x = torch.randn(m, 896, generator=g)
        for path in paths:
            if m > GEMV_ROWS and (path or "float") == "float":
                continue  # torch's GEMM over dequantized slabs: MKL's, which follows the thread count
            assert same(on_threads(lambda: p.matmul(x, path=path), 3)), (fmt, path, m)


def test_decode_attention_over_many_chunks():
    """Sequences long enough that their chunks spread over the threads (f32 and bf16 rows)."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        spans = [Span(torch.randn(2, n, 64, generator=g).to(dtype), torch.randn(2, n, 64, generator=g).to(dtype), 0, n)
                 for n in (1000, 300, 7)]
        q = torch.randn(3, 6, 64, generator=g)
        assert same(on_threads(lambda: attend_rows(q, spans, 0.125), 3)), dtype


def _greedy(loaded, spec: EngineSpec) -> dict:
    """A batch of 3 (prompts of 5, 40 and 300 tokens: prefill GEMMs, attention over several chunks),
    6 greedy tokens each: their ids and logits."""
    ids = loaded.tokenizer.encode(open(os.path.join(ROOT, "docs", "architecture.md")).read()[:6000])
    gen = GenerationConfig(max_tokens=6, stop_at_eos=False)
    seqs = [Sequence(loaded.model, ids[7 * i:7 * i + n], spec, gen, key=n) for i, n in enumerate((5, 40, 300))]
    out: dict = {}
    for e in Scheduler(loaded.model, parallel=3).run(seqs):
        assert e.seq.error is None
        if e.token is not None:
            out.setdefault(e.seq.key, []).append((e.token.id, e.token.logits))
    return out


@pytest.mark.parametrize("path,weights,engine", [
    ("models/smollm2-135m-instruct", "int8", "canonical"),
    pytest.param("models/smollm2-135m-instruct", "native", "codec", marks=pytest.mark.heavy),
    pytest.param("models/smollm2-135m-instruct", None, "canonical", marks=pytest.mark.heavy),
    pytest.param("models/gguf/qwen2.5-coder-0.5b-instruct.gguf", None, "canonical", marks=pytest.mark.heavy),
])
def test_greedy_decode_of_a_batch(path, weights, engine, monkeypatch):
    """Reference models, as the server runs them: the same ids and logits on 1 thread and 2."""
    if not os.path.exists(os.path.join(ROOT, path)):
        pytest.fail(f"{path} is missing: run `make model` (make test does it)")
    monkeypatch.setenv("LARQLPY_FOLLOW_LOAD", "0")  # the counts this test sets, not the load's
    loaded = load(os.path.join(ROOT, path), device="cpu", weights=weights)
    spec = preset_spec(RECOMMENDED) if engine == "codec" else EngineSpec()
    one, two = on_threads(lambda: _greedy(loaded, spec))
    assert one.keys() == two.keys()
    for key in one:
        assert [t for t, _ in one[key]] == [t for t, _ in two[key]], key
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(one[key], two[key])), key
    assert np.isfinite(one[300][0][1].numpy()).all()


def test_a_measured_choice_holds_for_every_thread_count(tmp_path, monkeypatch):
    """The candidates round differently: a 2-thread process must run what a 1-thread one chose."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[str] = []
    pick = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    chosen = []
    for n in (1, 2):
        monkeypatch.setattr(threads, "_planned", n)
        monkeypatch.setattr(choice, "_memo", {})  # as a new process would
        torch.set_num_threads(n)
        chosen.append(choice.choose("a shape", pick))
        if n == 1:
            calls.clear()
    assert chosen[0] == chosen[1] and calls == []


@njit(parallel=True)
def _take_all(chunks, slots, seen):  # pragma: no cover - jitted
    count = workshare.counter()
    for s in prange(slots):
        c = workshare.take(count)
        while c < chunks:
            seen[s, c] += 1
            c = workshare.take(count)


def test_each_chunk_is_taken_once():
    """The counter is shared by the threads (not a copy each): every chunk is taken, by one of them."""
    for n in (1, 2):
        numba.set_num_threads(n)
        seen = np.zeros((workshare.slots(), 20000), np.int64)
        _take_all(20000, workshare.slots(), seen)
        assert (seen.sum(0) == 1).all(), n
    count = workshare.counter()
    assert [workshare.take(count) for _ in range(3)] == [0, 1, 2]
