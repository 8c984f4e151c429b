"""Mixed-precision codec engines: k_bits / v_bits, exact sinks, per-layer widths (codec options and
cells/v1 rules), their accounting, and the recommended configuration's quality on the real 270M."""

from __future__ import annotations

import pytest
import torch

from larqlpy.cli.common import error_line
from larqlpy.engines import build_provider, parse_engine_spec, preset_spec
from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.options import parse_layer_bits
from larqlpy.engines.presets import RECOMMENDED
from larqlpy.engines.stores.base import AttentionParams
from larqlpy.engines.stores.state import Scratch
from larqlpy.engines.stores.codec import CodecStore
from larqlpy.engines.stores.kvcodec import KVCodec
from larqlpy.errors import LarqlError
from larqlpy.kernels.kvcodec.codebooks import MSE
from larqlpy.kernels.kvcodec.lloyd_max import gaussian_codebook
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec
from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec
from larqlpy.tools.residency import named_geometry

CPU = torch.device("cpu")


def spec(identity, *opts):
    return parse_engine_spec(continuation=identity, options=list(opts))


@pytest.mark.parametrize("bits", [2, 5, 6, 8])
def test_new_widths_numba_and_torch_identical(bits):
    assert abs(gaussian_codebook(bits)[2] - MSE[bits]) < 1e-12  # the shipped codebook is Lloyd-Max's
    for d in (64, 256):
        x = torch.randn(700, d, generator=torch.Generator().manual_seed(bits + d)) * 3
        x[5] = 0.0
        a, b = TurboQuantCodec(d, bits, CPU), TorchCodec(d, bits, CPU)
        enc = a.encode(x)
        norms, codes = b.encode(x)
        assert torch.equal(enc["norm"], norms) and torch.equal(enc["code"], codes)
        assert codes.shape == (700, d * bits // 8)
        y = a.decode(enc)
        assert torch.equal(y, b.decode(norms, codes)) and torch.equal(y[5], torch.zeros(d))
        err = ((y - x) / x.norm(dim=-1, keepdim=True).clamp_min(1e-9)).pow(2).sum(-1)
        assert abs(err[torch.arange(700) != 5].mean().item() - MSE[bits]) < 0.15 * MSE[bits]


def test_packing_is_little_endian_groups_of_eight():
    idx = torch.tensor([[1, 30, 7, 0, 31, 2, 16, 9]])
    word = sum(v << (5 * k) for k, v in enumerate(idx[0].tolist()))
    c5 = TorchCodec(8, 5, CPU)
    assert c5.pack(idx).tolist() == [[(word >> (8 * j)) & 0xFF for j in range(5)]]
    assert torch.equal(c5.unpack_values(c5.pack(idx)), c5.centroids[idx])
    assert TorchCodec(8, 8, CPU).pack(torch.tensor([[200, 1, 2, 3, 4, 5, 6, 255]])).tolist()[0] == \
        [200, 1, 2, 3, 4, 5, 6, 255]


@pytest.mark.parametrize("opts, message", [
    (["k_bits=7", "v_bits=3"], "must be one of 2, 3, 4, 5, 6, 8"),
    (["k_bits=5"], "requires option bits (or k_bits and v_bits)"),
    (["v_bits=3", "sink=-1"], "must be >= 0"),
    (["bits=4", "layer_bits=5:8"], "expected K/V widths"),
    (["bits=4", "layer_bits=5:8/4,5:exact"], "layer 5 given twice"),
    (["bits=4", "layer_bits=x:8/4"], "expected LAYER:K/V or LAYER:exact"),
    (["bits=4", "bogus=1"], "has no option 'bogus'"),
])
def test_refusals_are_one_line_and_suggest_the_recommended_configuration(opts, message):
    with pytest.raises(LarqlError) as e:
        spec("codec/v1", *opts)
    text = error_line(e.value)  # as the CLI says it: the suggestion spelled as flags
    assert message in text and "\n" not in text
    assert "recommended: --continuation codec/v1" in text
    assert "recommended: codec/v1 bits=4 calib=on recent=16 sink=1" in str(e.value)  # the library's spelling


def test_layer_bits_beyond_the_model_are_refused():
    with pytest.raises(LarqlError, match="names layer 40, the model has 18"):
        build_provider(spec("codec/v1", "bits=4", "layer_bits=40:8/4")).check_geometry(named_geometry("gemma3-270m"))


def test_parse_layer_bits():
    assert parse_layer_bits("11:exact, 5:8/4") == ((5, (8, 4)), (11, None))
    # stored (and saved with states) as a canonical string, so a resumed state re-validates it
    assert dict(spec("codec/v1", "bits=4", "layer_bits=11:exact, 5:8/4").options)["layer_bits"] == "5:8/4,11:exact"


def independent_bytes(kb, vb, positions, window, sink=0, recent=0, exact_layer=False, d=256, hkv=1):
    """What one layer stores, counted from the format description (not from the codec objects)."""
    rows = positions if window is None else min(positions, window)
    per_row = 2 * d * 4 if exact_layer else (4 + d * kb // 8) + (4 + d * vb // 8)
    return hkv * (rows * per_row + min(positions, sink) * 2 * d * 4 + min(positions, recent) * d * 4)


def test_accounting_matches_an_independent_count():
    geoms = named_geometry("gemma3-270m")
    p = build_provider(spec("codec-recent/v1", "k_bits=5", "v_bits=3", "sink=4", "exact_recent_k=16",
                            "layer_bits=5:8/2,11:exact"))
    for n in (0, 3, 600, 5000):
        for g in geoms:
            kb, vb = {5: (8, 2)}.get(g.index, (5, 3))
            assert p.layer_bytes(g, n) == independent_bytes(kb, vb, n, g.window, 4, 16, g.index == 11), (g.index, n)
    # bits per value at 4,096 positions of the recommended configuration: 4.125 + the sinks' share
    from larqlpy.tools.residency import bits_per_value

    rec = build_provider(preset_spec(RECOMMENDED))
    b = bits_per_value(rec, geoms, 4096)
    assert 4.0 < b <= 4.5


def run_store(store, steps, gen, hq=4, hkv=1, d=64):
    p = AttentionParams(scale=0.125)
    outs = []
    for t in steps:
        q, k, v = (torch.randn(h, t, d, generator=gen) for h in (hq, hkv, hkv))
        outs.append((store.attend(q, k, v, p), k, v))
    return outs


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_and_recent_rows_come_back_exact_and_fused_equals_scratch(window):
    g = LayerGeometry(0, window, 1, 64)
    kc, vc = TurboQuantCodec(64, 5, CPU), TurboQuantCodec(64, 3, CPU)

    def make(fused=True):
        return CodecStore(g, CPU, codec=KVCodec(kc, vc), keep=window, scratch=Scratch(CPU), exact_keys=2, sink=3,
                          fused=fused)

    fused, plain = make(), make(fused=False)
    gen_a, gen_b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    steps = (2, 1, 1, 1, 3, 1, 1)
    p = AttentionParams(scale=0.125)
    k_all, v_all = [], []
    for t in steps:
        q, k, v = (torch.randn(h, t, 64, generator=gen_a) for h in (4, 1, 1))
        for _ in range(3):
            torch.randn(1, generator=gen_b)
        a = fused.attend(q, k, v, p)
        b = plain.attend(q, k, v, p)  # decode to scratch, then plain attention
        assert (a - b).abs().max().item() < 1e-4
        k_all.append(k)
        v_all.append(v)
    k_all, v_all = torch.cat(k_all, 1), torch.cat(v_all, 1)
    if window is None:
        keys, values = fused.read(0, torch.float32)
        assert torch.equal(keys[:, :3], k_all[:, :3]) and torch.equal(values[:, :3], v_all[:, :3])  # sinks
        assert not torch.equal(values[:, 3:], v_all[:, 3:])  # the rest are codes
    keys, _ = fused.read(fused.end - 2, torch.float32)
    assert torch.equal(keys, k_all[:, -2:])  # the newest exact_recent K rows
    # the codes are those plain codec/v1 writes
    ref = CodecStore(g, CPU, codec=KVCodec(kc, vc), keep=window, scratch=Scratch(CPU))
    for t, (lo, hi) in zip(steps, [(0, 2), (2, 3), (3, 4), (4, 5), (5, 8), (8, 9), (9, 10)]):
        ref.append(k_all[:, lo:hi], v_all[:, lo:hi])
        ref.release()
    a, b = ref.rows.read(*ref.retained()), fused.rows.read(*fused.retained())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_cells_rules_apply_per_layer_widths(tmp_path):
    from larqlpy.engines.stores.kvcodec import precision_widths
    from larqlpy.engines.lifecycle import default_rules_path
    from tiny import make_tiny
    from larqlpy.weights.loader import load
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence
    from larqlpy.decode.stream import generate_step

    text = default_rules_path().read_text().replace("  bits: 4 ", "  bits: 4\n  k_bits: 5\n  v_bits: 3\n"
                                                    "  layer_bits: {0: 8/2, 1: exact}\n  #") \
        .replace("keep_active_recent: 128", "keep_active_recent: 0")
    rules = tmp_path / "mixed.yaml"
    rules.write_text(text)
    make_tiny(tmp_path / "m", sliding_window=4096)
    loaded = load(tmp_path / "m")
    s = spec("cells/v1", f"rules={rules}", "budget=300KiB")
    seq = Sequence(loaded.model, [2] + [7 + (i * 37) % 250 for i in range(290)], s,
                   GenerationConfig(max_tokens=4, stop_at_eos=False))
    list(generate_step(loaded.model, seq))
    state = seq.state
    seen = {}
    for store in state.layers:
        # QUANTIZED cells, and PERSISTED ones that were quantized first, carry their widths
        seen[store.geometry.index] = {c.precision for c in store.cells if c.precision != "f32"}
    assert seen[0] == {"tq8/2"} and precision_widths("tq8/2") == (8, 2)
    assert seen[1] == set()  # exact: never quantized
    assert all(v <= {"tq5/3"} for i, v in seen.items() if i > 1) and any(v for i, v in seen.items() if i > 1)
    for store in state.layers:
        for c in store.cells:
            if c.state.value == "QUANTIZED":
                kb, vb = precision_widths(c.precision)
                assert c.data["k_code"].shape[-1] == 16 * kb // 8 and c.data["v_code"].shape[-1] == 16 * vb // 8


@pytest.mark.heavy  # a quality aim over a long text, as the calibration's
def test_recommended_configuration_keeps_quality_on_270m(real, long_text):
    """The recommended default, teacher-forced on real text after a 400-token prompt (96 decode steps):
    below llama.cpp's q4_0 KV (KL 0.06) and well below plain 4-bit codec/v1 (measured: 0.047 vs 0.170).
    The issue's aim (KL <= 0.01 at <= 4.5 bits) is not reached; see docs/codec.md."""
    from larqlpy.tools.quality import forced_score, teacher_forced_logits

    ids = real.tokenizer.encode(long_text)[:496]
    prompt, forced = ids[:400], ids[400:]
    ref = teacher_forced_logits(real.model, parse_engine_spec(), prompt, forced)
    rec = forced_score(real.model, preset_spec(RECOMMENDED), prompt, forced, ref)
    plain = forced_score(real.model, spec("codec/v1", "bits=4", "calib=off", "sink=0", "recent=0"), prompt, forced, ref)
    assert rec["mean_kl"] < 0.06, rec
    assert rec["mean_kl"] < plain["mean_kl"] / 3 and rec["loss"] < plain["loss"], (rec, plain)
