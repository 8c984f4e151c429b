"""Low-bit weights (--weights bf16|int8|int4): the packing, the kernels, the model, state and CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from larqlpy.cli.common import error_line
from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.config import GenerationConfig
from larqlpy.decode.stream import stream_generate
from larqlpy.kernels.weights import choice, prefetch
from larqlpy.kernels.weights.qweight import GROUP, TILE, PackedWeight
from larqlpy.weights.loader import load
from larqlpy.state.saved import save
from larqlpy.tools.quality import score_text
from test_state import resume, run
from tiny import make_tiny

FORMATS = ("bf16", "int8", "int4")


def reference_dequant(w: np.ndarray, fmt: str) -> np.ndarray:
    """What each format should hold, computed independently with numpy from the float32 matrix."""
    if fmt == "bf16":
        bits = w.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16  # round to nearest even
        return rounded.astype(np.uint32).view(np.float32)
    g = w.reshape(w.shape[0], -1, GROUP)
    if fmt == "int8":  # Q8_0's grid: the scale max|w| / 127, rounded to float16
        scale = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore"):
            q = np.clip(np.rint(g * np.where(scale > 0, np.float32(1) / scale, 0)), -127, 127)
        return (q.astype(np.float32) * scale).reshape(w.shape)
    raise AssertionError(fmt)


def packed_matrix(fmt, n=200, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, :GROUP] = 0.0  # an all-zero group: scale 0 must not produce NaNs
    return w, PackedWeight.quantize(w, fmt)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_packing_matches_an_independent_reference(fmt):
    w, p = packed_matrix(fmt)
    got = p.rows(torch.arange(w.shape[0]))
    assert torch.equal(got, torch.from_numpy(reference_dequant(w.numpy(), fmt)))


def test_int4_error_is_within_half_a_step_and_affine_grids_come_back_exactly():
    w, p = packed_matrix("int4")
    got = p.rows(torch.arange(w.shape[0]))
    g = w.view(w.shape[0], -1, GROUP)
    step = (g.amax(-1) - g.amin(-1)) / 11  # the coarsest step the search may choose (11 steps)
    err = (got - w).abs().view_as(g).amax(-1)
    # half a step, plus what rounding the scale and minimum to float16 moves a value (2^-11 of each)
    slack = (15 * step + g.amin(-1).abs()) * 2.0 ** -11
    assert (err <= step / 2 + slack + 1e-7).all()
    assert p.scale.dtype == torch.int16  # float16 bits: 5 bits per weight
    # Values written on an affine 4-bit grid with float16 step and offset (Q4_1's), not always
    # reaching level 15: they come back exactly.
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 13, (64, 64), generator=gen).float()
    q[:, 0::GROUP] = 0
    q[:, 1::GROUP] = 12
    scale = (torch.rand(64, 2, 1, generator=gen) * 0.01 + 0.001).half().float()
    grid = (q.view(64, 2, GROUP) * scale + torch.tensor(-0.03).half().float()).view(64, 64)
    back = PackedWeight.quantize(grid, "int4").rows(torch.arange(64))
    assert torch.equal(back, grid)


@pytest.mark.parametrize("fmt", FORMATS)
def test_numba_and_torch_dequantize_to_the_same_bits(fmt):
    _, p = packed_matrix(fmt, n=TILE * 2 + 7)
    idx = torch.tensor([0, 5, TILE - 1, TILE, 2 * TILE + 6, 3])
    assert torch.equal(p.rows(idx), p._rows_torch(idx))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_and_slab_gemm_agree_with_the_dequantized_matrix(fmt, monkeypatch):
    w, p = packed_matrix(fmt, n=TILE * 3 + 5, k=128)
    dense = p.rows(torch.arange(w.shape[0]))
    x = torch.randn(1, 128)
    want = F.linear(x.double(), dense.double()).float()
    got = p.matmul(x, path="float")  # float activations; the int8-activation paths: test_kernels.py
    assert got.shape == (1, w.shape[0])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    x3 = torch.randn(3, 128)  # a few rows: the decode kernels
    assert torch.allclose(p.matmul(x3, path="float"), F.linear(x3, dense), atol=1e-5, rtol=1e-4)
    monkeypatch.setattr("larqlpy.kernels.weights.qweight.SLAB_BYTES", 1)  # one tile per slab: the slab loop runs
    monkeypatch.setattr("larqlpy.kernels.weights.qweight.GEMV_ROWS", 4)
    xs = torch.randn(9, 128)
    assert torch.allclose(p.matmul(xs, path="float"), F.linear(xs, dense), atol=1e-5, rtol=1e-4)


def test_inputs_must_split_into_groups():
    with pytest.raises(LarqlError, match="not a multiple of the group size"):
        PackedWeight.quantize(torch.zeros(8, 40), "int4", "layers.0.q_proj")


def test_unknown_precision_is_refused(tmp_path):
    with pytest.raises(LarqlError) as e:
        load(tmp_path, weights="int3")
    assert "--weights: expected one of f32, bf16, int8, int4, native" in error_line(e.value)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_model_runs_at_every_precision(tiny_dir, fmt):
    ref, low = load(tiny_dir, device="cpu"), load(tiny_dir, device="cpu", weights=fmt)
    assert low.weight_bytes < ref.weight_bytes
    ids = [2] + [7 + (i * 37) % 280 for i in range(60)]
    s = score_text(ref.model, low.model, ids, chunk=25)
    assert s.tokens == len(ids) - 1
    assert s.mean_kl < {"bf16": 1e-4, "int8": 1e-3, "int4": 0.05}[fmt]


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_the_loader_gives_every_matrix_the_measured_prefetch_distance(tiny_dir, fmt, tmp_path, monkeypatch):
    """The distance is measured on the model's own matrices at load (kernels/weights/prefetch.py) and kept per
    machine; the model's outputs are the same whatever it is."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(choice, "_memo", {})
    ids = torch.tensor([2, 9, 40, 7, 11])
    plain = load(tiny_dir, device="cpu", weights=fmt)
    assert {w.ahead for w in packed_matrices(plain)} == {0}  # a tiny model: in a cache, not measured
    monkeypatch.setattr(prefetch, "MEASURED_BYTES", 0)
    measured = load(tiny_dir, device="cpu", weights=fmt)
    kind = "bf16 rows" if fmt == "bf16" else "codes"
    stored = json.loads((tmp_path / "larqlpy" / "kernel-choices.json").read_text())
    best = [int(v) for k, v in stored.items() if k.endswith(f"| {kind} prefetched ahead, cached weights")]
    assert len(best) == 1 and {w.ahead for w in packed_matrices(measured)} == set(best)
    for w in packed_matrices(measured):
        w.ahead = 8192
    state = [new_state(EngineSpec(), m.model.geometries(), torch.device("cpu")) for m in (plain, measured)]
    assert torch.equal(plain.model(ids, state[0], all_logits=True), measured.model(ids, state[1], all_logits=True))


def packed_matrices(loaded) -> list[PackedWeight]:
    return [w for w in loaded.held_weights() if isinstance(w, PackedWeight)]


@pytest.mark.parametrize("fmt", ["int4", "native"])
def test_exact_engines_stay_bit_identical_at_low_precision(real_dir, long_text, fmt):
    low = load(real_dir, device="cpu", weights=fmt)
    ids = low.tokenizer.encode(long_text)[:560]  # past the 512-row window
    out = {}
    for identity in ("canonical/v1", "window/v1"):
        spec = parse_engine_spec(continuation=identity)
        toks = list(stream_generate(low.model, ids, spec,
                                    GenerationConfig(max_tokens=6, stop_at_eos=False, prefill_chunk=200)))
        out[identity] = torch.stack([t.logits for t in toks])
    assert torch.equal(out["canonical/v1"], out["window/v1"])


@pytest.fixture(scope="module")
def real_low(real_dir):
    return {fmt: load(real_dir, device="cpu", weights=fmt) for fmt in ("int8", "int4")}


# Measured over these 383 positions, int8 activations on the CPU: int8 KL 0.0054, loss +1.1%, top-1 97%;
# int4 KL 0.22, loss +8.8%, top-1 76% (most of this GGUF's tensors were 5-8-bit: 4 bits is a real
# loss; see docs/weights.md).
@pytest.mark.parametrize("fmt, max_kl, max_loss, min_top1", [("int8", 0.01, 1.02, 0.95), ("int4", 0.3, 1.12, 0.7)])
def test_real_270m_quality(real, real_low, long_text, fmt, max_kl, max_loss, min_top1):
    ids = real.tokenizer.encode(long_text)[:384]
    s = score_text(real.model, real_low[fmt].model, ids, chunk=192)
    assert s.mean_kl < max_kl
    assert s.test_loss < max_loss * s.ref_loss
    assert s.top1 > min_top1


def test_state_records_its_weights_and_resume_refuses_others(real_dir, real_low, tmp_path):
    low = real_low["int4"]
    spec = parse_engine_spec(continuation="window/v1")
    ids = low.tokenizer.encode("The history of the printing press begins in")
    _, held = run(low, spec, ids, 4)
    path = tmp_path / "s.kv"
    save(low, path, held)
    with pytest.raises(LarqlError) as e:
        resume(real_low["int8"], path, None, None)
    assert "made with --weights int4, this run loads the model with --weights int8" in error_line(e.value)
    got, _, _ = resume(low, path, None, None)
    assert got.held.state.position == len(ids) + 3


def test_resume_in_a_new_process_at_int4_is_bit_identical(real_dir, real_low, tmp_path):
    from test_state import resume_elsewhere

    low = real_low["int4"]
    spec = parse_engine_spec(continuation="codec/v1", options=["bits=4"])
    ids = low.tokenizer.encode("Question: Why is the sky blue? Answer:")
    cfg = lambda n: GenerationConfig(max_tokens=n, stop_at_eos=False)  # noqa: E731
    whole = list(stream_generate(low.model, ids, spec, cfg(10)))
    first, held = run(low, spec, ids, 4)
    assert held.tokens == ids + [t.id for t in first]
    save(low, tmp_path / "s.kv", held)
    got = resume_elsewhere(real_dir, tmp_path / "s.kv", 6, tmp_path, "int4")
    assert [t.id for t in whole[4:]] == got["ids"]
    assert torch.equal(torch.stack([t.logits for t in whole[4:]]), got["logits"])


def test_cli_weights_flag(real_dir, tmp_path):
    cli = [sys.executable, "-m", "larqlpy.cli.main"]
    r = subprocess.run(cli + ["run", str(real_dir), "Question: What is the capital of France? Answer:", "-n", "4",
                              "--weights", "int8", "--json", "--save-state", str(tmp_path / "s.kv")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["weights"] == "int8" and len(res["tokens"]) == 4
    r = subprocess.run(cli + ["state", "inspect", str(tmp_path / "s.kv"), "--json"], capture_output=True, text=True)
    assert json.loads(r.stdout)["weights"] == "int8"
    r = subprocess.run(cli + ["run", str(real_dir), "", "-n", "2", "--resume", str(tmp_path / "s.kv")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "made with --weights int8" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cli + ["run", str(real_dir), "hi", "--weights", "q4"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["larqlpy: error: --weights: expected one of f32, bf16, int8, int4, "
                                             "native, got 'q4'"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_slabs_hold_the_same_bits_as_the_rows(fmt):
    w, p = packed_matrix(fmt, n=TILE * 3 + 5, k=96)
    assert torch.equal(p._slab(1, 3).T, p._rows_torch(torch.arange(TILE, 3 * TILE)))


def test_int4_keeps_a_q4_1_ggufs_blocks_exactly(smol):
    """SmolLM2's GGUF stores its matrices as Q4_1 (affine 4-bit groups of 32, float16 d and m), the
    grid int4 packs into: dequantized by the converter and packed again, every value comes back bit
    for bit. (Q4_K's d * sc is not a float16: those come back within float16 rounding; `weights`
    native keeps them exactly.)"""
    for block in smol.model.layers[::6]:
        for name in ("q_proj", "down_proj"):
            w = getattr(block, name)
            assert torch.equal(PackedWeight.quantize(w, "int4").rows(torch.arange(w.shape[0])), w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_torch_path_cuda_takes_runs_on_the_cpu_too(fmt):
    """Off the CPU there are no numba views: every product dequantizes slabs with torch ops. Drop the
    views to send the CPU down that same path."""
    w, p = packed_matrix(fmt, n=TILE * 2 + 3, k=64)
    dense = p.rows(torch.arange(w.shape[0]))
    p.arrays = ()
    for t in (1, 5):
        x = torch.randn(t, 64)
        assert torch.allclose(p.matmul(x), F.linear(x, dense), atol=1e-5, rtol=1e-4)
    idx = torch.tensor([[1, 2], [TILE + 1, 0]])
    assert torch.equal(p.rows(idx), dense[idx])


def test_stacked_parts_equal_matrices_packed_alone():
    from larqlpy.kernels.weights.matvec import linears
    from larqlpy.kernels.weights.qweight import stack

    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 64, generator=g) for n in (96, 32, 32)]
    parts = stack(ws, "int4", "qkv")
    x = torch.randn(1, 64)
    for w, part, y in zip(ws, parts, linears(x, *parts)):
        alone = PackedWeight.quantize(w, "int4")
        assert torch.equal(part.rows(torch.arange(w.shape[0])), alone.rows(torch.arange(w.shape[0])))
        assert torch.allclose(y, alone.matmul(x), atol=1e-6)
