"""`kv_dtype`: exact K/V rows kept in f32, f16 or bf16 -- rounded once as they are stored, read back
the same by every path, so window/v1 stays bit-identical to canonical/v1 at each dtype; half the
bytes at 16 bits; recorded in saved states and checked on resume; the default follows the weights."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from larqlpy.cli.common import error_line
from larqlpy.engines import EngineSpec, build_provider, new_state, parse_engine_spec, preset_spec
from larqlpy.errors import LarqlError
from larqlpy.kernels.attention.decode import Span, attend_rows
from larqlpy.state.saved import save
from larqlpy.tools.residency import residency
from larqlpy.weights.loader import load
from test_exact_engines import CANONICAL, WINDOW, horizon_checker, run_steps
from test_state import PROMPT, resume, resume_elsewhere, run
from tiny import make_tiny

HALF = {"f16": torch.float16, "bf16": torch.bfloat16}
RULES = """version: 1
cell_size: 8
policy: {keep_active_recent: 8, quantize_layers: none}
rules:
  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}
  - {event: MEMORY_PRESSURE, from: ACTIVE, to: PERSISTED}
  - {event: READ_REQUEST, from: ACTIVE, to: ACTIVE}
  - {event: CACHE_MISS, from: PERSISTED, to: RECOVERING}
  - {event: WRITE_BACK, from: RECOVERING, to: PERSISTED}
  - {event: EVICT, from: ACTIVE, to: EVICTED}
  - {event: EVICT, from: PERSISTED, to: EVICTED}
"""


def _values() -> torch.Tensor:
    """Every kind of float32 a row may hold: ties, subnormals, overflow, infinities, NaN, -0."""
    torch.manual_seed(3)
    wide = torch.randn(4032) * torch.logspace(-45, 38, 4032, base=2)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.4e38, 65504.0, 65520.0,
                            1.00390625, 1.01171875, -1.00390625, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25])
    ties = (torch.arange(50, dtype=torch.float32) + 0.5) * 2.0 ** -10 + 1.0  # halfway between f16 / bf16 values
    return torch.cat([wide, special, ties])[:4096]


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_the_decode_kernel_rounds_a_written_row_as_torch_does(kv):
    dt, d = HALF[kv], 64
    vals = _values().reshape(-1, 1, 1, d)
    for row in vals:
        kb, vb = torch.zeros(1, 1, d, dtype=dt), torch.zeros(1, 1, d, dtype=dt)
        attend_rows(torch.zeros(1, 1, d), [Span(kb, vb, 0, 1, 0, True)], 1.0, 0.0, (row, -row), [0])
        want_k, want_v = row.to(dt), (-row).to(dt)
        nan = torch.isnan(want_k)
        assert torch.isnan(kb[nan]).all() and torch.isnan(vb[nan]).all()
        assert torch.equal(kb.view(torch.int16)[~nan], want_k.view(torch.int16)[~nan])
        assert torch.equal(vb.view(torch.int16)[~nan], want_v.view(torch.int16)[~nan])


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_16_bit_rows_score_as_their_f32_values_bit_for_bit(kv):
    """The kernel widens a chunk of 16-bit rows and runs the f32 arithmetic: the same bits as f32
    buffers holding the same values, for one sequence or many, rings and long rows alike."""
    torch.manual_seed(0)
    dt, hkv, h, d = HALF[kv], 2, 8, 64
    spans16, spans32 = [], []
    for n, ring, first in ((300, 0, 0), (40, 0, 5), (200, 256, 130)):
        k, v = (torch.randn(hkv, max(n + first, ring), d).to(dt) for _ in "kv")
        spans16.append(Span(k, v, first, n, ring))
        spans32.append(Span(k.float(), v.float(), first, n, ring))
    q = torch.randn(3, h, d)
    assert torch.equal(attend_rows(q, spans16, d ** -0.5), attend_rows(q, spans32, d ** -0.5))
    one16, one32 = attend_rows(q[:1], spans16[:1], 0.1, 30.0), attend_rows(q[:1], spans32[:1], 0.1, 30.0)
    assert torch.equal(one16, one32)  # softcapped


# each dtype, each blocking: heavy on the 270M, where CI keeps test_exact_engines' f32 check and the
# tiny model's f16 and bf16 below
@pytest.mark.parametrize("kv, chunks", [pytest.param("f16", [700], marks=pytest.mark.heavy),
                                        pytest.param("bf16", [300, 250, 150], marks=pytest.mark.heavy)])
def test_window_is_bit_identical_to_canonical_at_16_bits_on_270m(real, long_text, kv, chunks):
    ids = real.tokenizer.encode(long_text)[:700]  # past the 512-token window
    ref = run_steps(real, CANONICAL, ids, chunks, 16, horizon_checker(lambda g: None), kv_dtype=kv)
    got = run_steps(real, WINDOW, ids, chunks, 16, horizon_checker(lambda g: g.window), kv_dtype=kv)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]) and ref[2] == got[2]
    f32 = run_steps(real, CANONICAL, ids, chunks, 16)
    assert not torch.equal(ref[1], f32[1])  # the rows really were kept at 16 bits ...
    p, q = torch.log_softmax(f32[0], -1), torch.log_softmax(ref[0], -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < (2e-4 if kv == "f16" else 5e-3), kl  # ... and they change the model's answers little


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_window_bit_identical_on_a_tiny_model_at_16_bits(tmp_path, kv):
    make_tiny(tmp_path, sliding_window=5)
    loaded = load(tmp_path, device="cpu", kv_dtype=kv)
    assert {g.kv_dtype for g in loaded.model.geometries()} == {kv}
    ids = list(range(10, 47))
    for chunks in ([37], [4, 9, 1, 23], [1] * 37):
        ref = run_steps(loaded, CANONICAL, ids, chunks, 20)
        got = run_steps(loaded, WINDOW, ids, chunks, 20, horizon_checker(lambda g: g.window))
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]) and ref[2] == got[2]


def test_16_bit_rows_hold_half_the_bytes_and_the_accounting_agrees(real, real_dir, long_text):
    ids = torch.tensor(real.tokenizer.encode(long_text)[:600])
    held = {}
    for kv in ("f32", "f16", "bf16"):
        geoms = [dataclasses.replace(g, kv_dtype=kv) for g in real.model.geometries()]
        for spec in (CANONICAL, WINDOW):
            state = new_state(spec, geoms, real.device)
            state.reserve(600)
            real.model(ids, state)
            held[kv, spec.identity] = state.resident_bytes()
            provider = build_provider(spec)
            assert held[kv, spec.identity] == sum(provider.layer_bytes(g, 600) for g in geoms)
        r = residency(str(real_dir), 600, [CANONICAL, WINDOW], kv_dtype=kv)
        assert [e["bytes"] for e in r["engines"]] == [held[kv, "canonical/v1"], held[kv, "window/v1"]]
    for identity in ("canonical/v1", "window/v1"):
        assert held["f16", identity] * 2 == held["f32", identity] == held["bf16", identity] * 2


def test_the_default_follows_the_weights(real_dir, tmp_path):
    assert load(real_dir, device="cpu").kv_dtype == "f32"  # f32 weights: the exact baseline
    assert load(real_dir, device="cpu", weights="int8").kv_dtype == "f16"
    assert load(real_dir, device="cpu", weights="int8", kv_dtype="f32").kv_dtype == "f32"
    assert residency(str(real_dir), 10, [CANONICAL])["kv_dtype"] == "f32"
    with pytest.raises(LarqlError, match="`kv_dtype`: expected f32 | f16 | bf16, got 'f8'"):
        load(real_dir, kv_dtype="f8")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


@pytest.mark.parametrize("preset", [("canonical/v1", ()), ("window/v1", ()),
                                    ("codec-recent/v1", (("k_bits", 8), ("v_bits", 2), ("sink", 3),
                                                         ("exact_recent_k", 5))),
                                    ("cells/v1", (("budget", "10KiB"),))],
                         ids=lambda p: p[0] + "".join(f",{k}={v}" for k, v in p[1]))
def test_bf16_states_resume_in_a_new_process_bit_identical(tiny_dir, tmp_path, preset):
    tiny = load(tiny_dir, device="cpu", kv_dtype="bf16")
    if preset[0] == "cells/v1":  # small cells, never quantized: over the budget, exact cells go to disk
        rules = tmp_path / "rules.yaml"
        rules.write_text(RULES)
        preset = (preset[0], preset[1] + (("rules", str(rules)),))
    spec = preset_spec(preset)
    whole, _ = run(tiny, spec, PROMPT, 20)
    first, held = run(tiny, spec, PROMPT, 8)
    if preset[0] == "cells/v1":  # the budget sent exact cells to disk: their bf16 bits went there too
        assert held.state.report()["spilled_bytes"] > 0
    save(tiny, tmp_path / "s.kv", held)
    got = resume_elsewhere(tiny_dir, tmp_path / "s.kv", 12, tmp_path, "f32", "bf16")
    assert [t.id for t in whole[8:]] == got["ids"]
    assert torch.equal(torch.stack([t.logits for t in whole[8:]]), got["logits"])


def test_a_state_records_its_kv_dtype_and_resume_refuses_another(tiny_dir, tmp_path):
    half = load(tiny_dir, device="cpu", kv_dtype="f16")
    _, held = run(half, EngineSpec(), PROMPT, 4)
    save(half, tmp_path / "s.kv", held)
    with pytest.raises(LarqlError) as e:
        resume(load(tiny_dir, device="cpu"), tmp_path / "s.kv", None, None)
    assert "made with --kv-dtype f16, this run loads the model with --kv-dtype f32" in error_line(e.value)
    got, _, _ = resume(half, tmp_path / "s.kv", None, None)
    assert got.held.state.position == len(PROMPT) + 3


def test_cli_kv_dtype(tiny_dir, tmp_path):
    cli = [sys.executable, "-m", "larqlpy.cli.main"]
    r = subprocess.run(cli + ["run", str(tiny_dir), "a b c", "-n", "3", "--kv-dtype", "bf16", "--json",
                              "--save-state", str(tmp_path / "s.kv")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kv_dtype"] == "bf16"
    r = subprocess.run(cli + ["state", "inspect", str(tmp_path / "s.kv"), "--json"], capture_output=True, text=True)
    summary = json.loads(r.stdout)
    assert summary["kv_dtype"] == "bf16"
    assert all(k.endswith(" bf16") for layer in summary["layers"] for k in layer["cells"])
    r = subprocess.run(cli + ["residency", str(tiny_dir), "--positions", "64", "--kv-dtype", "f16", "--json",
                              "--continuation", "canonical/v1"], capture_output=True, text=True)
    assert json.loads(r.stdout)["kv_dtype"] == "f16"
    spec = parse_engine_spec(continuation="canonical/v1")
    geoms = load(tiny_dir, device="cpu", kv_dtype="f16").model.geometries()
    assert json.loads(r.stdout)["engines"][0]["bytes"] == sum(build_provider(spec).layer_bytes(g, 64) for g in geoms)
